"""Departed workers leave the consumer groups (issue #25): once a dead worker's pending entries
are reclaimed and its heartbeat is gone, a survivor removes it (XGROUP DELCONSUMER, in a script
that checks its pending list in the same step); a consumer that still holds entries, or whose
heartbeat is live, is never removed. On real redis-servers: the scripted check in-process, the
SIGKILL with ``tokenrelay worker`` subprocesses."""

from __future__ import annotations

import pytest

from tokenrelay.protocol.keys import GROUP, Keys
from tokenrelay.protocol.scripts import text
from tests.fault_harness import FaultEnv, wait_for
from tokenrelay.worker.pending import PendingList

pytestmark = pytest.mark.timeout(180)

KEYS = Keys("dc", "q")


def consumers(r, keys: Keys) -> set[str]:
    out: set[str] = set()
    for lane in keys.lanes():
        if r.exists(lane):
            out |= {text(c["name"]) for c in r.xinfo_consumers(lane, GROUP)}
    return out


def test_only_consumers_without_entries_or_heartbeat_are_removed(redis_server):
    r = redis_server.client()
    lane = KEYS.lane("default")
    r.xgroup_create(lane, GROUP, id="0", mkstream=True)
    for i in range(3):
        r.xadd(lane, {"data": f"job {i}"})
    holding = r.xreadgroup(GROUP, "dead-holding", {lane: ">"}, count=1)
    done = r.xreadgroup(GROUP, "dead-done", {lane: ">"}, count=1)
    r.xack(lane, GROUP, done[0][1][0][0])
    r.xreadgroup(GROUP, "live-idle", {lane: ">"}, count=1)
    r.xack(lane, GROUP, r.xpending_range(lane, GROUP, "-", "+", 10, "live-idle")[0]["message_id"])
    r.hset(KEYS.heartbeat("live-idle"), "ts", 1)
    pending = PendingList(r, KEYS, "me")
    asked: list[list[str]] = []

    def alive(names: list[str]) -> list[bool]:
        asked.append(names)
        return [bool(r.exists(KEYS.heartbeat(n))) for n in names]
    assert pending.drop_departed(alive) == [(lane, "dead-done")]
    assert asked == [["dead-done", "live-idle"]]        # one holding an entry is not even asked
    assert consumers(r, KEYS) == {"dead-holding", "live-idle"}
    assert holding and len(r.xpending_range(lane, GROUP, "-", "+", 10)) == 1
    r.close()


def test_a_killed_workers_consumer_disappears_once_its_jobs_are_reclaimed(tmp_path, request):
    env = FaultEnv(tmp_path, namespace="dc", queue="q")
    request.addfinalizer(env.close)
    workers = {wid: env.worker(wid, wait=False) for wid in ("w1", "w2")}
    for w in workers.values():
        w.wait_for_log("worker ready", timeout=120)
    jobs = env.submit([f"prompt {i}" for i in range(12)], max_tokens=40, temperature=0.0,
                      ignore_eos=True)
    wait_for(lambda: env.tokens_streamed(jobs) >= 12 * 3, 60, what="tokens flowing")
    victim = max(workers, key=lambda wid: len(env.held_by(wid)))
    survivor = next(w for w in workers if w != victim)
    assert env.held_by(victim), "the victim held nothing when killed: the test proved nothing"
    assert victim in consumers(env.r, env.keys)
    workers[victim].kill()
    env.assert_exactly_once(env.wait_ended(jobs, timeout=120))
    wait_for(lambda: victim not in consumers(env.r, env.keys), 60,
             what=f"{victim} removed from the consumer groups")
    assert survivor in consumers(env.r, env.keys)
    wait_for(lambda: "departed workers removed" in env.logs(), 10, what="the removal logged")
