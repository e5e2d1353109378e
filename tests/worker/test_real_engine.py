"""The worker driving the real engine (tiny random-weight checkpoint, CPU).

One engine is built per module and shared by the in-process workers of these tests (loading
one costs seconds); each test leaves it empty.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from typing import Any

import pytest

from tokenrelay.protocol.keys import Keys
from tokenrelay.worker.config import WorkerSettings
from tokenrelay.worker.service import Worker
from tests.fault_harness import read_events, submit, wait_for_terminal

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tokenrelay.engine.llm_engine") is None,
                                reason="engine.llm_engine not available yet")

KEYS = Keys()
ENGINE_KW = dict(kv_cache_memory_bytes=64 * 2**20, max_num_seqs=16, max_model_len=256)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    from tokenrelay.engine.llm import LLM
    return LLM(str(tiny_checkpoint("llama")), **ENGINE_KW)


@pytest.fixture
def engine(llm):
    """The LLM's own engine, empty before and after each test."""
    yield llm.engine
    for rid in list(llm.engine.requests):
        llm.engine.abort_request(rid)


def start(redis_server, engine: Any, worker_id: str = "rw", **kw: Any):
    settings = WorkerSettings(redis_url=redis_server.url, worker_id=worker_id, model="unused",
                              block_ms=50, heartbeat_ms=200, **kw)
    w = Worker(settings, engine=engine)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    assert w.ready.wait(15)
    return w, t


def stop(w: Worker, t: threading.Thread, force: bool = False) -> None:
    w.stop(force=force)
    t.join(15)
    assert not t.is_alive()


PROMPTS = ["Hello there, how are you", "The quick brown fox", "a", "Once upon a time " * 6]


def test_streamed_text_equals_offline_generate(redis_server, llm, engine):
    from tokenrelay.engine.sampling_params import SamplingParams
    lens = [12, 5, 20, 9]
    expected = [llm.generate(p, SamplingParams(temperature=0, max_tokens=n))[0].outputs[0]
                for p, n in zip(PROMPTS, lens)]
    chat = [{"role": "user", "content": "hi there"}]
    expected_chat = llm.chat(chat, SamplingParams(temperature=0, max_tokens=7))[0].outputs[0]
    r = redis_server.client()
    w, t = start(redis_server, engine)
    try:
        for i, (p, n) in enumerate(zip(PROMPTS, lens)):
            submit(r, KEYS, {"job_id": f"g{i}", "prompt": p,
                             "params": {"temperature": 0, "max_tokens": n}})
        submit(r, KEYS, {"job_id": "chat", "messages": chat,
                         "params": {"temperature": 0, "max_tokens": 7}, "stream": False})
        out = wait_for_terminal(r, KEYS, [f"g{i}" for i in range(4)] + ["chat"], 60)
    finally:
        stop(w, t)
    for i, exp in enumerate(expected):
        events = out[f"g{i}"]
        text = "".join(e.text for e in events if e.type == "token")
        ids = [tid for e in events if e.type == "token" for tid in e.token_ids]
        assert text == exp.text and ids == exp.token_ids, i
        assert events[-1].finish_reason == exp.finish_reason
    done = out["chat"][-1]
    assert done.text == expected_chat.text and done.token_ids == expected_chat.token_ids


def test_takeover_resumes_sampled_job_exactly(redis_server, llm, engine):
    """Stop a sampled job half way (hand-back), resume it on another worker: the client's
    text equals an uninterrupted run with the recorded seed."""
    from tokenrelay.engine.sampling_params import SamplingParams
    r = redis_server.client()
    w1, t1 = start(redis_server, engine, worker_id="first", drain_timeout=0.0)
    # min_tokens: a random seed must not end the job on EOS before the hand-back (a run
    # stopped after 2 tokens and waited here in vain)
    submit(r, KEYS, {"job_id": "res", "prompt": "Resume me please",
                     "params": {"temperature": 0.9, "max_tokens": 40, "min_tokens": 40}})
    deadline = time.monotonic() + 30
    while len([e for e in read_events(r, KEYS, "res") if e.type == "token"]) < 5:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    stop(w1, t1, force=True)
    first = read_events(r, KEYS, "res")
    assert first[-1].type == "token", "job should have been handed back unfinished"
    seed = first[0].seed
    w2, t2 = start(redis_server, engine, worker_id="second")
    try:
        events = wait_for_terminal(r, KEYS, "res", 60)["res"]
    finally:
        stop(w2, t2)
    starts = [e for e in events if e.type == "started"]
    assert [s.worker_id for s in starts] == ["first", "second"] and starts[1].seed == seed
    ids = [tid for e in events if e.type == "token" for tid in e.token_ids]
    text = "".join(e.text for e in events if e.type == "token")
    ref = llm.generate("Resume me please",
                       SamplingParams(temperature=0.9, max_tokens=40, min_tokens=40,
                                      seed=seed))[0].outputs[0]
    assert ids == ref.token_ids and text == ref.text
    assert events[-1].usage.completion_tokens == len(ref.token_ids)


def test_prompt_too_long_and_invalid_token_ids(redis_server, engine):
    r = redis_server.client()
    w, t = start(redis_server, engine)
    try:
        submit(r, KEYS, {"job_id": "long", "prompt_token_ids": [5] * 250,
                         "params": {"max_tokens": 50}})
        submit(r, KEYS, {"job_id": "vocab", "prompt_token_ids": [10**9],
                         "params": {"max_tokens": 5}})
        submit(r, KEYS, {"job_id": "ok", "prompt": "fine", "params": {"max_tokens": 3}})
        out = wait_for_terminal(r, KEYS, ["long", "vocab", "ok"], 60)
    finally:
        stop(w, t)
    err = out["long"][-1]
    assert err.code == "prompt_too_long" and "250" in err.message and "256" in err.message
    assert out["vocab"][-1].code == "invalid_request" and "vocabulary" in out["vocab"][-1].message
    assert out["ok"][-1].type == "done"
