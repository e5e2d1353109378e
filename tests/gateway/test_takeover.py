"""A worker SIGKILLed while an HTTP client streams through the gateway: the worker processes
are ``tokenrelay worker --model fake:`` children (FaultEnv), another worker takes the job over,
and the SSE stream the openai client reads goes on to exactly the full completion of every
choice -- nothing repeated, nothing missing -- because the SDK's stream resumes across
takeovers and the gateway relays it as it is."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.fault_harness import FaultEnv
from tokenrelay.worker.fake_engine import fake_completion

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def env(tmp_path: Path):
    e = FaultEnv(tmp_path)
    try:
        yield e
    finally:
        e.close()


def test_sigkill_mid_stream_the_sse_stream_continues_without_repeats(env: FaultEnv,
                                                                     gateway_factory):
    env.worker("w1", delay=0.05)
    gw = gateway_factory(env.redis.url, namespace=env.keys.namespace, keepalive_s=0.5)
    client = openai.OpenAI(base_url=gw.v1, api_key="none", max_retries=0, timeout=120)
    prompt, tokens, seed = "takeover", 60, 21
    want = {i: fake_completion(prompt, tokens, seed=seed, greedy=False, choice=i)
            for i in range(2)}
    got: dict[int, str] = {0: "", 1: ""}
    reasons: dict[int, str] = {}
    killed = False
    stream = client.completions.create(model="fake", prompt=prompt, max_tokens=tokens, n=2,
                                       seed=seed, temperature=1.0, stream=True,
                                       stream_options={"include_usage": True})
    usage = None
    with stream:
        for chunk in stream:
            for ch in chunk.choices:
                got[ch.index] += ch.text
                if ch.finish_reason:
                    reasons[ch.index] = ch.finish_reason
            if chunk.usage is not None:
                usage = chunk.usage
            if not killed and len(got[0]) >= 10:
                assert env.held_by("w1"), "the job is not held by w1"
                env.workers[0].kill()                     # SIGKILL, mid-stream
                killed = True
                env.worker("w2", delay=0.01)
    assert killed
    assert got == want
    assert reasons == {0: "length", 1: "length"}
    assert usage is not None and usage.completion_tokens == 2 * tokens
    reports = env.streams(_job_ids(env))
    (report,) = reports.values()
    assert len(report.started) >= 2, "the job was not taken over"
    env.assert_exactly_once(reports)


def _job_ids(env: FaultEnv) -> list[str]:
    prefix = f"{env.keys.namespace}:result:{env.keys.tag(0)}:"
    return [k.decode()[len(prefix):] for k in env.r.scan_iter(match=prefix + "*")]
