"""``echo`` on ``/v1/completions`` (issue #40), through the gateway and a fake-engine worker:
the text of every choice starts with the prompt (whole, and in each choice's first streamed
chunk), responses validate strictly as the openai package's types; echo with logprobs (which
needs prompt logprobs the engine does not compute) and echo of a token-id prompt are 400s that
say so; chat keeps refusing it. The batch runner writes echoed lines the same way."""

from __future__ import annotations

import httpx
import openai
import pytest

from tokenrelay.producer_sdk.batch.lines import response_line
from tokenrelay.producer_sdk.batch.runner import parse_line
from tokenrelay.producer_sdk.jobs.results import CompletionOutput, Result
from tokenrelay.protocol.events import Usage
from tokenrelay.worker.fake_engine import fake_completion
from tests.gateway.helpers import chunk_texts, finish_reasons, stream_raw, strict_chunks

pytestmark = pytest.mark.timeout(120)
MODEL = "fake"
PROMPT = "Echo me, please."


@pytest.fixture
def gw(redis_server, start_worker, gateway_factory):
    start_worker()
    return gateway_factory(redis_server.url)


def post(gw, body: dict) -> httpx.Response:
    return httpx.post(f"{gw.v1}/completions", json={"model": MODEL, **body}, timeout=30)


def test_a_whole_answer_starts_with_the_prompt_in_every_choice(gw):
    from openai.types import Completion
    client = openai.OpenAI(base_url=gw.v1, api_key="none", max_retries=0)
    comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                     echo=True, n=2)
    want = PROMPT + fake_completion(PROMPT, 5)
    assert [c.text for c in comp.choices] == [want, want]
    assert comp.usage.completion_tokens == 10 and comp.usage.prompt_tokens == len(PROMPT)
    raw = post(gw, {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True})
    assert Completion.model_validate(raw.json(), strict=True).choices[0].text == \
        PROMPT + fake_completion(PROMPT, 3)
    plain = post(gw, {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": False})
    assert plain.json()["choices"][0]["text"] == fake_completion(PROMPT, 3)


def test_a_stream_sends_the_prompt_in_each_choices_first_chunk(gw):
    resp, events = stream_raw(f"{gw.v1}/completions", {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "echo": True,
        "n": 2, "stream": True, "stream_options": {"include_usage": True}})
    assert resp.status_code == 200
    chunks = strict_chunks(False, events)
    firsts = {}
    for chunk in chunks:
        for ch in chunk.choices:
            firsts.setdefault(ch.index, ch.text)
    assert set(firsts) == {0, 1} and all(t.startswith(PROMPT) for t in firsts.values())
    want = PROMPT + fake_completion(PROMPT, 6)
    assert chunk_texts(False, chunks) == {0: want, 1: want}
    assert finish_reasons(chunks) == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 12


@pytest.mark.parametrize("body, says", [
    ({"prompt": PROMPT, "echo": True, "logprobs": 1}, "echo with logprobs needs the prompt's "
                                                      "logprobs, which this engine does not"),
    ({"prompt": PROMPT, "echo": True, "logprobs": 0}, "echo with logprobs"),
    ({"prompt": [72, 105], "echo": True}, "a prompt of token ids cannot be echoed"),
    ({"prompt": PROMPT, "echo": "yes"}, "echo must be a boolean"),
])
def test_what_cannot_be_echoed_is_a_400_that_says_why(gw, body, says):
    r = post(gw, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "echo" and says in err["message"]


def test_chat_keeps_refusing_echo(gw):
    r = httpx.post(f"{gw.v1}/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_a_batch_line_with_echo_writes_the_prompt_first():
    tag, kwargs = parse_line({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                              "body": {"model": MODEL, "prompt": PROMPT, "echo": True}}, 1)
    assert tag.echo == PROMPT and kwargs["prompt"] == PROMPT and "echo" not in kwargs
    out = CompletionOutput(index=0, text=" and more", token_ids=[1, 2], finish_reason="length")
    result = Result(job_id="j1", text=out.text, finish_reason="length", outputs=[out],
                    usage=Usage(prompt_tokens=4, completion_tokens=2))
    line = response_line(tag, result)
    assert line["response"]["body"]["choices"][0]["text"] == PROMPT + " and more"
