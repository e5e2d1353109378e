"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's, issue #40): answered by a worker of the
model's queue through Redis (protocol/tokenize.py), so a count is the job's own
``usage.prompt_tokens``; routed, authenticated and refused like ``/v1/completions``; a worker
that does not answer is a 504; hostile calls end alone. Fake-engine workers for the contract,
the tiny llama checkpoint for a real tokenizer and chat template."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import msgpack
import openai
import pytest

from tokenrelay.protocol.keys import PAYLOAD_FIELD, Keys
from tokenrelay.protocol.tokenize import TokenizeAnswer, TokenizeCall, pack, unpack
from tokenrelay.worker.fake_engine import FakeEngine, fake_completion
from tests.fault_harness import wait_for
from tests.sdk_helpers import RealWorker

pytestmark = pytest.mark.timeout(180)
MODEL = "fake"
CHAT = [{"role": "user", "content": "Count my tokens."}]


def call(gw: Any, path: str, body: dict, **kw: Any) -> httpx.Response:
    return httpx.post(f"{gw.url}{path}", json=body, timeout=30, **kw)


@pytest.fixture
def gw(redis_server, start_worker, gateway_factory):
    start_worker()
    return gateway_factory(redis_server.url)


# -- the contract, on the fake engine (tokens are characters) ----------------------------

def test_tokenize_a_prompt_and_detokenize_it_back(gw):
    r = call(gw, "/tokenize", {"model": MODEL, "prompt": "hello"})
    assert r.status_code == 200, r.text
    assert r.json() == {"tokens": [ord(c) for c in "hello"], "count": 5, "max_model_len": 4096}
    back = call(gw, "/detokenize", {"model": MODEL, "tokens": r.json()["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "hello"}


def test_the_count_of_messages_is_the_chat_jobs_prompt_tokens(gw):
    r = call(gw, "/tokenize", {"model": MODEL, "messages": CHAT})
    rendered = FakeEngine().render_chat(CHAT)
    assert r.json()["tokens"] == [ord(c) for c in rendered]
    client = openai.OpenAI(base_url=gw.v1, api_key="none", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    comp = client.completions.create(model=MODEL, prompt="hello there", max_tokens=2,
                                     temperature=0)
    assert chat.usage.prompt_tokens == r.json()["count"]
    assert comp.usage.prompt_tokens == \
        call(gw, "/tokenize", {"model": MODEL, "prompt": "hello there"}).json()["count"]
    assert comp.choices[0].text == fake_completion("hello there", 2)


@pytest.mark.parametrize("path, body, status, param, says", [
    ("/tokenize", {"prompt": "x"}, 400, "model", "model is required"),
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model", "nope"),
    ("/tokenize", {"model": MODEL}, 400, None, "exactly one of prompt or messages"),
    ("/tokenize", {"model": MODEL, "prompt": "x", "messages": CHAT}, 400, None, "exactly one"),
    ("/tokenize", {"model": MODEL, "prompt": 5}, 400, "prompt", "string"),
    ("/tokenize", {"model": MODEL, "prompt": "x", "add_special_tokens": "yes"}, 400,
     "add_special_tokens", "boolean"),
    ("/tokenize", {"model": MODEL, "prompt": "x", "return_token_strs": True}, 400,
     "return_token_strs", "Extra inputs"),
    ("/tokenize", {"model": MODEL, "messages": CHAT, "add_generation_prompt": False}, 400,
     None, "only true is supported"),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role", "is not one of"),
    ("/detokenize", {"model": MODEL, "tokens": "abc"}, 400, "tokens", "list"),
    ("/detokenize", {"model": MODEL, "tokens": [104, -1]}, 400, "tokens",
     "token id -1 is outside the vocabulary"),
    ("/detokenize", {"model": MODEL, "tokens": [0x110000]}, 400, "tokens", "outside"),
])
def test_bad_calls_are_refused_naming_the_field(gw, path, body, status, param, says):
    r = call(gw, path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and says in err["message"], err
    ok = call(gw, "/tokenize", {"model": MODEL, "prompt": "still here"})    # ended alone
    assert ok.status_code == 200 and ok.json()["count"] == 10


def test_keys_are_required_like_the_other_routes(redis_server, start_worker, gateway_factory):
    start_worker()
    gw = gateway_factory(redis_server.url, api_keys=["sekrit"])
    body = {"model": MODEL, "prompt": "hi"}
    assert call(gw, "/tokenize", body).status_code == 401
    assert call(gw, "/detokenize", {"model": MODEL, "tokens": [104]}).status_code == 401
    r = call(gw, "/tokenize", body, headers={"Authorization": "Bearer sekrit"})
    assert r.status_code == 200 and r.json()["count"] == 2


def test_no_live_worker_is_503_and_a_silent_one_504(redis_server, start_worker, gateway_factory):
    gw = gateway_factory(redis_server.url, routes=["fake=default"], tokenize_timeout_s=0.5)
    r = call(gw, "/tokenize", {"model": MODEL, "prompt": "x"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_live_worker"
    running = start_worker()
    running.worker.tokenizing.close()           # a live worker that never answers
    t0 = time.monotonic()
    r = call(gw, "/tokenize", {"model": MODEL, "prompt": "x"})
    assert r.status_code == 504, r.text
    assert "--tokenize-timeout-s" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 5


def test_a_hostile_call_entry_is_dropped_and_the_next_answered(redis_server, start_worker):
    """A raw producer's garbage on the calls stream ends alone: the worker reads on."""
    start_worker()
    r = redis_server.client()
    keys = Keys()
    r.xadd(keys.tokenize_calls, {PAYLOAD_FIELD: b"\xc1 not msgpack"})
    r.xadd(keys.tokenize_calls, {PAYLOAD_FIELD: msgpack.packb({"id": "x y", "kind": "?"})})
    good = TokenizeCall(id="good1", kind="tokenize", prompt="ab")
    r.xadd(keys.tokenize_calls, pack(good))
    got = r.xread({keys.tokenize_reply("good1"): "0"}, block=10_000, count=1)
    assert got, "the valid call was not answered"
    answer = unpack(got[0][1][0][1], TokenizeAnswer)
    assert (answer.tokens, answer.count) == ([97, 98], 2)
    assert 0 < r.pttl(keys.tokenize_reply("good1")) <= 60_000
    wait_for(lambda: r.xlen(keys.tokenize_calls) == 0, timeout=10,
             what="every call acked and deleted")


# -- a real tokenizer and chat template (the tiny llama checkpoint) ----------------------

real = pytest.mark.skipif(importlib.util.find_spec("tokenrelay.engine.llm_engine") is None,
                          reason="the real engine is not available")


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def llm(checkpoint):
    from tokenrelay.engine.llm import LLM
    engine = LLM(str(checkpoint), kv_cache_memory_bytes=64 * 2**20, max_num_seqs=8,
                 max_model_len=256)
    yield engine
    engine.shutdown()


@pytest.fixture
def served(redis_server, llm, checkpoint, gateway_factory) -> Iterator[Any]:
    w = RealWorker(redis_server.url, llm.engine, "gw-tok", model=str(checkpoint)).start()
    try:
        yield gateway_factory(redis_server.url)
    finally:
        w.stop()


@real
def test_a_real_model_counts_what_its_jobs_count(served, llm, checkpoint):
    name = checkpoint.name
    tok = llm.engine.tokenizer
    prompt = "Once upon a time, a queue"
    r = call(served, "/tokenize", {"model": name, "prompt": prompt}).json()
    assert r["tokens"] == tok.encode(prompt) and r["max_model_len"] == 256
    bare = call(served, "/tokenize", {"model": name, "prompt": prompt,
                                      "add_special_tokens": False}).json()
    assert bare["tokens"] == tok.encode(prompt, add_special_tokens=False)
    chat = call(served, "/tokenize", {"model": name, "messages": CHAT}).json()
    assert chat["tokens"] == tok.encode(llm.engine.render_chat(CHAT), add_special_tokens=False)
    client = openai.OpenAI(base_url=served.v1, api_key="none", max_retries=0)
    comp = client.completions.create(model=name, prompt=prompt, max_tokens=1)
    answer = client.chat.completions.create(model=name, messages=CHAT, max_tokens=1)
    assert comp.usage.prompt_tokens == r["count"]
    assert answer.usage.prompt_tokens == chat["count"]
    text = call(served, "/detokenize", {"model": name, "tokens": bare["tokens"]}).json()
    assert text["prompt"] == tok.decode(bare["tokens"])
    vocab = llm.engine.vocab_size
    past = call(served, "/detokenize", {"model": name, "tokens": [vocab]})
    assert past.status_code == 400 and f"token id {vocab} is outside" in past.text
