"""Prefix affinity when the preferred worker dies: ``python -m worker`` processes (FakeEngine),
one SIGKILLed mid-conversation. The next turn is served by the other worker, and the jobs that
were in the dead worker's affinity stream -- running there (read, not acknowledged) and waiting
(unread) -- each finish exactly once elsewhere (the fault harness's stream oracle)."""

from __future__ import annotations

import pytest

from producer_sdk.affinity import rank
from producer_sdk.protocol import GROUP, parse_dedupe_record
from tests.fault_harness import FaultEnv, pending_summary, wait_for

pytestmark = pytest.mark.timeout(180)

MODEL = "fake:step_delay=0.05,max_num_seqs=2"


@pytest.fixture
def env(tmp_path):
    e = FaultEnv(tmp_path)
    try:
        yield e
    finally:
        e.close()


def started_on(env: FaultEnv, job_id: str) -> list[str]:
    return [ev.worker_id for ev in env.streams([job_id])[job_id].started]


def test_killed_preferred_worker_next_turn_elsewhere_and_its_jobs_end_once(env):
    wa = env.worker("wa", model=MODEL)
    env.worker("wb", model=MODEL)
    key = next(f"conv-{i}" for i in range(100) if rank(f"conv-{i}", ["wa", "wb"])[0] == "wa")
    keys = env.keys
    client = env.client(affinity_ttl_s=0)

    turn1 = client.submit("turn 1", routing_key=key, max_tokens=3)
    turn1.result(timeout=30)
    assert started_on(env, turn1.id) == ["wa"]

    # six jobs of the conversation: two run on wa (its capacity), four wait in its stream
    jobs = client.submit_many([{"prompt": f"turn 2.{i}", "routing_key": key} for i in range(6)],
                              max_tokens=40, block=False)
    ids = [j.id for j in jobs]
    assert {parse_dedupe_record(env.r.get(keys.dedupe(j)))[0] for j in ids} == {
        keys.affinity("wa", 0)}
    wait_for(lambda: all(env.tokens_streamed([j]) >= 3 for j in ids[:2]), 20,
             what="two jobs streaming on wa")
    assert env.r.xlen(keys.affinity("wa", 0)) == 6

    wa.kill()                                            # SIGKILL: no drain, no goodbye
    wait_for(lambda: not env.r.exists(keys.heartbeat("wa")), 10, what="wa's heartbeat expired")
    turn3 = client.submit("turn 3", routing_key=key, max_tokens=3)
    assert turn3.result(timeout=30).text
    assert started_on(env, turn3.id) == ["wb"]
    assert parse_dedupe_record(env.r.get(keys.dedupe(turn3.id)))[0] == keys.affinity("wb", 0)

    reports = env.wait_ended(ids, 60)
    env.assert_exactly_once(reports)
    assert all(r.kind == "done:length" and len(r.token_ids) == 40 for r in reports.values())
    for j in ids[:2]:                                    # resumed from their streams on wb
        assert started_on(env, j) == ["wa", "wb"]
    for j in ids[2:]:                                    # moved unread to the shared lane
        assert started_on(env, j) == ["wb"]
    wait_for(lambda: not env.r.exists(keys.affinity("wa", 0)), 10,
             what="the dead worker's emptied stream deleted")
    assert env.r.xpending(keys.affinity("wb", 0), GROUP)["pending"] == 0
    assert not pending_summary(env.r, keys)
