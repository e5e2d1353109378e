"""A worker SIGKILLed at each point of its overlapped flush (worker/cycle.py) loses nothing and
duplicates nothing: events built but not written, a terminal event written but its entry not
acked, acks written. The kill comes from the outbox's fault point (TOKENRELAY_FAULT_POINT, see
tests/fault_harness.py ``kill_at``), so it lands at that exact point whatever the timing; a
second worker then reclaims and resumes, and every stream is checked exact by the harness's
exactly-once oracle, with the text each job must have."""

from __future__ import annotations

import signal

import pytest

from tests.fault_harness import wait_for
from tokenrelay.worker.fake_engine import fake_completion
from tokenrelay.worker.outbox import FAULT_POINTS

SHORT, LONG = 8, 40     # tokens: the short jobs end (and are acked) while the long ones run


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point,nth", [("built", 4), ("written", 1), ("acked", 1)])
def test_a_kill_at_each_point_of_the_overlapped_flush_leaves_every_stream_exact(env, point,
                                                                                   nth):
    assert point in FAULT_POINTS
    short = [f"short {i} at {point}" for i in range(3)]
    long = [f"long {i} at {point}" for i in range(3)]
    params = dict(temperature=0.0, stream=True)
    ids = env.submit(short, prefix="s", max_tokens=SHORT, **params)
    ids += env.submit(long, prefix="l", max_tokens=LONG, **params)
    victim = env.worker("victim", env={"TOKENRELAY_FAULT_POINT": f"{point}:{nth}"})
    assert '"overlap_steps": true' in victim.log()        # the pipelined loop, not the serial one
    assert victim.wait(30) == -signal.SIGKILL
    assert f"fault point {point} #{nth} reached" in victim.log()
    held = env.held_by("victim")
    assert held, "the kill should leave entries for the survivor to reclaim"
    env.worker("survivor")
    reports = env.wait_ended(ids, timeout=60)
    env.assert_exactly_once(reports)
    expected = {**{f"s-{i}": fake_completion(p, SHORT) for i, p in enumerate(short)},
                **{f"l-{i}": fake_completion(p, LONG) for i, p in enumerate(long)}}
    assert {j: rep.text for j, rep in reports.items()} == expected
    assert {rep.kind for rep in reports.values()} == {"done:length"}
    # What the victim wrote stays and the survivor resumes after it: every job killed mid-way
    # has a second attempt that resumed tokens; a job whose terminal event the victim wrote
    # (written, acked) is never run again, acked by whoever finds its stream ended.
    attempts = {j: [(s.attempt, s.resumed_tokens) for s in rep.started]
                for j, rep in reports.items()}
    ended_by_victim = point in ("written", "acked")
    for j, seen in attempts.items():
        if j.startswith("s-") and ended_by_victim:
            assert seen == [(1, 0)], (j, seen)
        else:
            assert [a for a, _ in seen] == [1, 2] and seen[1][1] > 0, (j, seen)
    wait_for(lambda: not env.held_by("survivor"), 10, what="the survivor acked everything")
