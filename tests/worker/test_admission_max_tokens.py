"""worker/admission.py, a job without max_tokens: a chat job runs to the end of the context
(max_model_len minus its prompt, as OpenAI's and vLLM's chat endpoints do); a completion stops at
16 (OpenAI's completions default). Neither the SDK nor the batch runner fills in 16 for chat."""

from __future__ import annotations

import msgpack
import pytest

from tokenrelay.producer_sdk import Client
from tokenrelay.producer_sdk.openai.format import body_to_request
from tokenrelay.protocol.keys import Keys
from tests.fault_harness import submit, wait_for_terminal
from tokenrelay.worker.fake_engine import FakeEngine, FakeTokenizer

KEYS = Keys()
MESSAGES = [{"role": "user", "content": "hi"}]


def chat_prompt_tokens() -> int:
    return len(FakeTokenizer().encode(FakeEngine().render_chat(MESSAGES)))


@pytest.mark.timeout(60)
def test_chat_without_max_tokens_runs_to_the_context_end_a_completion_stops_at_16(
        redis_server, start_worker):
    start_worker(engine=FakeEngine(max_model_len=64))
    r = redis_server.client()
    submit(r, KEYS, {"job_id": "chat", "messages": MESSAGES, "params": {"temperature": 0}})
    submit(r, KEYS, {"job_id": "cmpl", "prompt": "hi", "params": {"temperature": 0}})
    submit(r, KEYS, {"job_id": "min", "messages": MESSAGES, "params": {"min_tokens": 30}})
    submit(r, KEYS, {"job_id": "cmin", "prompt": "hi", "params": {"min_tokens": 30}})
    submit(r, KEYS, {"job_id": "set", "messages": MESSAGES, "params": {"max_tokens": 5}})
    ends = {j: evs[-1] for j, evs in wait_for_terminal(
        r, KEYS, ["chat", "cmpl", "min", "cmin", "set"]).items()}
    room = 64 - chat_prompt_tokens()
    assert room > 16
    assert ends["chat"].usage.completion_tokens == room
    assert ends["chat"].usage.total_tokens == 64 and ends["chat"].finish_reason == "length"
    assert ends["min"].usage.completion_tokens == room
    assert ends["cmpl"].usage.completion_tokens == 16
    assert ends["set"].usage.completion_tokens == 5
    assert ends["cmin"].type == "error" and ends["cmin"].code == "invalid_request"
    assert "min_tokens" in ends["cmin"].message and "16" in ends["cmin"].message


@pytest.mark.timeout(60)
def test_chat_prompt_filling_the_context_is_prompt_too_long(redis_server, start_worker):
    start_worker(engine=FakeEngine(max_model_len=chat_prompt_tokens()))
    r = redis_server.client()
    submit(r, KEYS, {"job_id": "full", "messages": MESSAGES, "params": {}})
    end = wait_for_terminal(r, KEYS, "full")["full"][-1]
    assert end.type == "error" and end.code == "prompt_too_long"


def test_sdk_and_batch_lines_leave_max_tokens_unset_for_chat(redis_server):
    client = Client(redis_server.url)
    client.submit(messages=MESSAGES, temperature=0)
    req = body_to_request("/v1/chat/completions", {"model": "m", "messages": MESSAGES})
    client.submit(**req)
    for _, fields in client.redis.xrange(KEYS.lane("default")):
        payload = msgpack.unpackb(fields[b"data"], raw=False)
        assert "max_tokens" not in payload["params"], payload
    client.close()


@pytest.mark.timeout(60)
def test_chat_job_handed_back_past_16_tokens_resumes_to_the_context_end(redis_server,
                                                                       start_worker):
    """The default is resolved before the resume check: a takeover past 16 tokens must not
    take the job for finished at 16."""
    import time

    from tests.fault_harness import read_events
    first = start_worker(engine=FakeEngine(max_model_len=64, step_delay=0.02), worker_id="w1")
    r = redis_server.client()
    submit(r, KEYS, {"job_id": "long", "messages": MESSAGES, "params": {"temperature": 0}})
    deadline = time.monotonic() + 20
    while sum(e.type == "token" for e in read_events(r, KEYS, "long")) < 20:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    first.stop(force=True)
    start_worker(engine=FakeEngine(max_model_len=64), worker_id="w2")
    events = wait_for_terminal(r, KEYS, "long")["long"]
    room = 64 - chat_prompt_tokens()
    assert events[-1].usage.completion_tokens == room
    assert sum(len(e.token_ids) for e in events if e.type == "token") == room
    assert max(e.attempt for e in events if e.type == "started") == 2
