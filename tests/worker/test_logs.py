"""What a worker logs (#18), from a real ``tokenrelay worker --model fake:`` at the default level:
one INFO line when a job starts and one when it ends, the producer's W3C traceparent on both, and
the engine's configuration once at start-up."""

from __future__ import annotations

import json

import pytest

from tokenrelay.producer_sdk.errors import InvalidRequest
from tests.fault_harness import FaultEnv, wait_for

pytestmark = pytest.mark.timeout(90)
TRACE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def env(tmp_path):
    e = FaultEnv(tmp_path)
    yield e
    e.close()


def lines(wp) -> list[dict]:
    return [json.loads(x) for x in wp.log().splitlines() if x.startswith("{")]


def test_one_info_line_at_start_and_end_of_each_job_with_its_traceparent(env):
    w = env.worker("w1", log_level="info")
    client = env.client()
    traced = client.submit("traced", max_tokens=4, temperature=0.0, traceparent=TRACE)
    plain = client.submit("plain", max_tokens=4, temperature=0.0)
    traced.result(timeout=30)
    plain.result(timeout=30)
    env.wait_ended([traced.id, plain.id], timeout=30)

    def ended_in_log() -> bool:
        # A job's end line is logged after the flush that wrote its terminal event, so the
        # client can see the result a moment before the line is in the log.
        events = [(x.get("job_id"), x["event"]) for x in lines(w)]
        return all((j.id, "finished") in events for j in (traced, plain))

    wait_for(ended_in_log, 10, what="both end lines logged")
    log = lines(w)
    for job in (traced, plain):
        mine = [x["event"] for x in log if x.get("job_id") == job.id]
        assert mine == ["started", "finished"], mine
    for x in log:
        if x.get("job_id") == traced.id:
            assert x["traceparent"] == TRACE, x
    (loaded,) = [x for x in log if x["event"] == "engine loaded"]
    assert loaded["engine"] == "FakeEngine" and loaded["kv_blocks"] > 0


@pytest.mark.parametrize("bad", ["not-a-trace", "00-" + "0" * 31 + "-00f067aa0ba902b7-01",
                                 TRACE.upper()])
def test_a_malformed_traceparent_is_refused_before_enqueue(env, bad):
    with pytest.raises(InvalidRequest, match="traceparent"):
        env.client().submit("x", traceparent=bad)
