"""``logit_bias`` through the gateway (issue #40): a worker running our engine on the tiny llama
checkpoint takes the favoured token every time and never the banned one, as the offline engine
does with the same map; hostile maps end their own request with a 400 naming the field."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.sdk_helpers import RealWorker

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("single_thread"),
              pytest.mark.skipif(importlib.util.find_spec("tokenrelay.engine.llm_engine") is None,
                                 reason="the real engine is not available")]

ENGINE_KW = dict(kv_cache_memory_bytes=64 * 2**20, max_num_seqs=16, max_model_len=256)
PROMPT = "Once upon a time"
FAVOURED = 123


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def llm(checkpoint):
    from tokenrelay.engine.llm import LLM
    engine = LLM(str(checkpoint), **ENGINE_KW)
    yield engine
    engine.shutdown()


@pytest.fixture
def served(redis_server, llm, checkpoint, gateway_factory) -> Iterator[tuple[Any, RealWorker]]:
    w = RealWorker(redis_server.url, llm.engine, "gw-bias", model=str(checkpoint)).start()
    try:
        yield gateway_factory(redis_server.url), w
    finally:
        w.stop()


def greedy(max_tokens: int = 6, **extra: Any):
    from tokenrelay.engine.sampling_params import SamplingParams
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)


@pytest.fixture(scope="module")
def offline(llm) -> dict[str, Any]:
    """What the engine gives offline (before any worker holds it): plain greedy, +100 on
    FAVOURED, -100 on the plain answer's first token."""
    plain = llm.generate(PROMPT, greedy())[0].outputs[0]
    banned = plain.token_ids[0]
    return {"plain": plain, "banned": banned,
            "forced": llm.generate(PROMPT, greedy(logit_bias={FAVOURED: 100}))[0].outputs[0],
            "ban": llm.generate(PROMPT, greedy(logit_bias={banned: -100}))[0].outputs[0]}


def test_completions_force_and_ban_tokens_as_the_offline_engine(offline, served, llm, checkpoint):
    gw, _ = served
    assert offline["forced"].token_ids == [FAVOURED] * 6
    assert offline["banned"] not in offline["ban"].token_ids
    client = openai.OpenAI(base_url=gw.v1, api_key="none", max_retries=0)
    body = dict(model=checkpoint.name, prompt=PROMPT, max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True})
    plain = client.completions.create(**body)
    forced = client.completions.create(**body, logit_bias={str(FAVOURED): 100})
    ban = client.completions.create(**body, logit_bias={str(offline["banned"]): -100})
    chat = client.chat.completions.create(
        model=checkpoint.name, messages=[{"role": "user", "content": PROMPT}], max_tokens=4,
        temperature=0, logit_bias={str(FAVOURED): 100}, extra_body={"ignore_eos": True})
    assert plain.choices[0].text == offline["plain"].text
    assert forced.choices[0].text == offline["forced"].text != offline["plain"].text
    assert ban.choices[0].text == offline["ban"].text
    assert chat.choices[0].message.content == llm.engine.tokenizer.decode([FAVOURED] * 4)


@pytest.mark.parametrize("bias, says", [
    ({"5": 101}, "outside [-100, 100]"),
    ({"five": 1}, "is not a token id"),
    ({"5": "high"}, "must be a number"),
    ({str(i): 1 for i in range(301)}, "limit of 300"),
])
def test_a_bad_map_is_a_400_naming_logit_bias(served, checkpoint, bias, says):
    gw, _ = served
    r = httpx.post(f"{gw.v1}/completions", timeout=30,
                   json={"model": checkpoint.name, "prompt": PROMPT, "logit_bias": bias})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and says in err["message"]


def test_an_id_past_the_vocabulary_is_refused_by_the_worker(served, llm, checkpoint):
    gw, _ = served
    vocab = llm.engine.vocab_size
    r = httpx.post(f"{gw.v1}/completions", timeout=60,
                   json={"model": checkpoint.name, "prompt": PROMPT, "max_tokens": 2,
                         "logit_bias": {str(vocab): 1}})
    assert r.status_code == 400, r.text
    assert f"logit_bias: token id {vocab} is outside the vocabulary" in r.json()["error"]["message"]
    ok = httpx.post(f"{gw.v1}/completions", timeout=60,         # the worker serves on
                    json={"model": checkpoint.name, "prompt": PROMPT, "max_tokens": 2,
                          "temperature": 0, "logit_bias": {str(vocab - 1): 100}})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
