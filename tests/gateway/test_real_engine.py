"""The gateway over a real worker running our engine on the tiny llama checkpoint (CPU): what
the openai client gets equals what the offline engine generates, token for token; stop strings,
seeded sampling, usage and logprobs. One engine per module (building it costs seconds), served
by an in-process worker per test, which is stopped before the engine is used offline."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.gateway.helpers import chunk_texts, finish_reasons, stream_raw, strict_chunks
from tests.sdk_helpers import RealWorker

pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(
    importlib.util.find_spec("tokenrelay.engine.llm_engine") is None
    or importlib.util.find_spec("tokenrelay.worker.service") is None,
    reason="the real engine/worker are not available")]

ENGINE_KW = dict(kv_cache_memory_bytes=64 * 2**20, max_num_seqs=32, max_model_len=256)
CHAT = [{"role": "user", "content": "Tell me about queues."}]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def llm(checkpoint):
    from tokenrelay.engine.llm import LLM
    return LLM(str(checkpoint), **ENGINE_KW)


@pytest.fixture
def served(redis_server, llm, checkpoint, gateway_factory) -> Iterator[tuple[Any, RealWorker]]:
    w = RealWorker(redis_server.url, llm.engine, "gw-real", model=str(checkpoint)).start()
    try:
        yield gateway_factory(redis_server.url), w
    finally:
        w.stop()


def test_greedy_completion_and_chat_equal_the_offline_engine(served, llm, checkpoint):
    from tokenrelay.engine.sampling_params import SamplingParams
    gw, worker = served
    name = checkpoint.name          # the served model name: the checkpoint folder's
    client = openai.OpenAI(base_url=gw.v1, api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == [name]
    comp = client.completions.create(model=name, prompt="Once upon a time", max_tokens=12,
                                     temperature=0, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(model=name, messages=CHAT, max_tokens=10,
                                          temperature=0, extra_body={"ignore_eos": True})
    _, events = stream_raw(f"{gw.v1}/chat/completions", {
        "model": name, "messages": CHAT, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}})
    chunks = strict_chunks(True, events)
    worker.stop()                   # the engine is free again: compare with offline generation
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = llm.generate("Once upon a time", greedy)[0]
    assert comp.choices[0].text == want.outputs[0].text
    assert (comp.usage.prompt_tokens, comp.usage.completion_tokens) == \
        (len(want.prompt_token_ids), 12)
    want_chat = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert chat.choices[0].message.content == want_chat.outputs[0].text
    assert chat.usage.prompt_tokens == len(want_chat.prompt_token_ids)
    assert chunk_texts(True, chunks) == {0: want_chat.outputs[0].text}
    assert finish_reasons(chunks) == {0: "length"}
    assert chunks[-1].usage.total_tokens == len(want_chat.prompt_token_ids) + 10


def test_stop_strings_seeds_and_logprobs(served, checkpoint):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion
    gw, _ = served
    name = checkpoint.name
    client = openai.OpenAI(base_url=gw.v1, api_key="none", max_retries=0)
    body = {"model": name, "prompt": "The queue said", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True}
    sdk_body = {k: v for k, v in body.items() if k != "ignore_eos"}
    extra = {"extra_body": {"ignore_eos": True}}
    full = client.completions.create(**sdk_body, **extra).choices[0].text
    stop = full[5:7]
    assert stop.strip(), f"pick another slice of {full!r}"
    cut = client.completions.create(**sdk_body, **extra, stop=[stop]).choices[0]
    assert (cut.text, cut.finish_reason) == (full[:full.index(stop)], "stop")
    _, events = stream_raw(f"{gw.v1}/completions", {**body, "stop": stop, "stream": True})
    chunks = strict_chunks(False, events)
    assert chunk_texts(False, chunks) == {0: cut.text}
    assert finish_reasons(chunks) == {0: "stop"}
    # Seeded sampling is reproducible; n = 2 gives two different choices.
    seeded = dict(model=name, prompt="Roll the dice", max_tokens=12, temperature=1.0, seed=9, n=2)
    a, b = client.completions.create(**seeded), client.completions.create(**seeded)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text and a.usage.completion_tokens == 24
    # Logprobs: one entry per token, the asked-for number of alternatives, and (greedy) the
    # chosen token is the likeliest of them.
    raw = httpx.post(f"{gw.v1}/chat/completions", timeout=60, json={
        "model": name, "messages": CHAT, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
        "logprobs": True, "top_logprobs": 3}).json()
    parsed = ChatCompletion.model_validate(raw, strict=True)
    content = parsed.choices[0].logprobs.content
    assert len(content) == 6 == parsed.usage.completion_tokens
    # Each token named by its text, as the worker's tokenizer decodes it: together, the reply.
    assert "".join(e.token for e in content) == parsed.choices[0].message.content
    assert not any(e.token.startswith("token_id:") for e in content)
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.top_logprobs[0].token == entry.token
    raw = httpx.post(f"{gw.v1}/completions", timeout=60, json={**body, "logprobs": 2}).json()
    lp = Completion.model_validate(raw, strict=True).choices[0].logprobs
    assert len(lp.tokens) == 16 == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
