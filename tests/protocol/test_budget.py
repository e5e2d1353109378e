"""The one cost function of the token budget (protocol/budget.py), and that every way the SDK
builds a payload (the bulk template path included) carries the cost ``job_cost`` gives it."""

from __future__ import annotations

import msgpack
import pytest

from tokenrelay.producer_sdk.jobs.payloads import PayloadBuilder
from tokenrelay.protocol.budget import (BYTES_PER_TOKEN, DEFAULT_MAX_TOKENS, entry_cost, job_cost,
                             prompt_tokens, text_tokens)
from tokenrelay.protocol.keys import Keys

pytestmark = pytest.mark.timeout(30)


def test_text_is_estimated_from_utf8_bytes_rounded_up():
    assert text_tokens("") == 0
    assert text_tokens("abc") == 1 and text_tokens("abcd") == 2
    assert text_tokens("a" * 3000) == 3000 // BYTES_PER_TOKEN
    # a CJK character is 3 UTF-8 bytes: about one token each, never under-counted
    assert text_tokens("\u4e2d" * 100) == 100
    assert text_tokens("\U0001f600") == 2           # 4 bytes


def test_token_ids_are_counted_exactly_and_chat_includes_the_template_stand_in():
    assert prompt_tokens(prompt_token_ids=list(range(777))) == 777
    chat = [{"role": "user", "content": "a" * 300}]
    assert prompt_tokens(messages=chat) > text_tokens("a" * 300)
    with_tools = prompt_tokens(messages=chat, tools=[{"type": "function", "function": {
        "name": "lookup", "description": "x" * 600}}])
    assert with_tools >= prompt_tokens(messages=chat) + 200


def test_completion_part_max_tokens_times_choices_or_beams_else_what_the_worker_gives():
    assert job_cost({"prompt": "abc", "params": {"max_tokens": 100}}) == 101
    assert job_cost({"prompt": "abc", "params": {"max_tokens": 100, "n": 4}}) == 401
    assert job_cost({"prompt": "abc", "params": {"max_tokens": 10, "beam_width": 3}}) == 31
    assert job_cost({"prompt": "abc"}) == 1 + DEFAULT_MAX_TOKENS           # completions' 16
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    prompt = prompt_tokens(messages=chat["messages"])
    assert job_cost(chat, context_tokens=4096) == 4096                       # to the end
    assert job_cost({**chat, "params": {"n": 2}}, context_tokens=4096) == \
        prompt + 2 * (4096 - prompt)
    assert job_cost({"prompt_token_ids": [1] * 5000, "messages": None}, 4096) == \
        5000 + DEFAULT_MAX_TOKENS


def test_entry_cost_reads_what_the_enqueue_stored_and_zero_for_anything_else():
    assert entry_cost(b"123") == 123 and entry_cost("7") == 7
    assert entry_cost(None) == 0 and entry_cost(b"x") == 0 and entry_cost(b"-5") == 0


@pytest.mark.parametrize("defaults", [{"max_tokens": 64}, {"max_tokens": 8, "n": 3}, {}])
def test_the_bulk_template_path_carries_the_same_cost_as_the_general_path(defaults):
    builder = PayloadBuilder(Keys())
    prompts = ["short", "ü" * 50, "x" * 1000]
    for p in builder.build_many(prompts, defaults, 1):
        payload = msgpack.unpackb(p.payload, raw=False)
        assert p.cost == job_cost(payload) == builder.build(
            payload["prompt"], job_id="x", submitted_ms=1, **defaults).cost
    chat = builder.build_request({"messages": [{"role": "user", "content": "hey"}]}, {})
    assert chat.cost == job_cost(msgpack.unpackb(chat.payload, raw=False))
