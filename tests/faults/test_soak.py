"""Soak: 2,000 jobs through two workers while one of them is SIGKILLed and restarted every few
seconds; the jobs go in four waves, each after a kill once the restart is ready, so at least three
kills land mid-stream however fast the host is. Every job must end exactly once with each token
once, nothing may stay pending, and once the (short) result TTL lapses Redis must hold no per-job
key and return to its baseline memory: nothing leaks, whatever the kills interrupted.
"""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

from tokenrelay.protocol.keys import EVENT_FIELD
from tokenrelay.protocol.wire import decode_event
from tests.fault_harness import FaultEnv, RepeatedKills, pending_summary, wait_for
from tokenrelay.worker.fake_engine import fake_completion

N_JOBS = 2000
MAX_TOKENS = 8
RESULT_TTL_S = 6
KILL_AFTER_READY_S = 1.0
WAVES = 4             # the jobs go in four waves, the next after each kill


class StreamFollower:
    """Reads every job's result stream as a client would, from the last id seen, so events are
    captured before the streams expire."""

    def __init__(self, env: FaultEnv, job_ids: list[str]) -> None:
        self.env = env
        self.last = {j: "-" for j in job_ids}
        self.events: dict[str, list] = defaultdict(list)
        self.ended: set[str] = set()

    def poll(self) -> None:
        open_ids = [j for j in self.last if j not in self.ended]
        pipe = self.env.r.pipeline(transaction=False)
        for j in open_ids:
            start = self.last[j]
            pipe.xrange(self.env.keys.results(j), "-" if start == "-" else f"({start}")
        for j, entries in zip(open_ids, pipe.execute()):
            for eid, fields in entries:
                self.last[j] = eid.decode()
                ev = decode_event(fields[EVENT_FIELD])
                self.events[j].append(ev)
                if ev.type in ("done", "error"):
                    self.ended.add(j)

    def describe(self, job_id: str) -> list[tuple]:
        """(type, worker, attempt, resumed tokens, seq) of each event, for failure messages."""
        return [(e.type, getattr(e, "worker_id", None), getattr(e, "attempt", None),
                 getattr(e, "resumed_tokens", None), getattr(e, "seq", None))
                for e in self.events[job_id]]

    def problems(self, job_id: str, prompt: str) -> list[str]:
        evs = self.events[job_id]
        out = []
        terminals = [e for e in evs if e.type in ("done", "error")]
        if len(terminals) != 1 or evs[-1] is not terminals[0]:
            out.append(f"{len(terminals)} terminal events")
        tokens = [e for e in evs if e.type == "token"]
        if [e.seq for e in tokens] != list(range(len(tokens))):
            out.append(f"seqs {[e.seq for e in tokens]}")
        text = "".join(e.text for e in tokens)
        if terminals and terminals[0].type == "done" and text != fake_completion(prompt,
                                                                                 MAX_TOKENS):
            out.append(f"text {text!r}")
        return out


def per_job_keys(env: FaultEnv) -> dict[str, int]:
    """Per-job keys still in Redis, counted by kind (none once every TTL has lapsed)."""
    ns = env.keys.namespace
    counts = {kind: sum(1 for _ in env.r.scan_iter(f"{ns}:{kind}:*", count=1000))
              for kind in ("result", "job", "owner", "cancel")}
    return {kind: n for kind, n in counts.items() if n}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_soak_2000_jobs_with_a_worker_killed_every_few_seconds(env):
    # dedupe_ttl: a job that waited past the SDK's dedupe TTL is bound again by the worker that
    # starts it, for the worker's --dedupe-ttl (a day by default): short here, like the SDK's
    flags = dict(max_num_seqs=32, result_ttl=RESULT_TTL_S, dedupe_ttl=RESULT_TTL_S,
                 max_deliveries=10, delay=0.02)
    env.worker("w1", **flags)
    victim = RepeatedKills(env, "w2", after_ready_s=KILL_AFTER_READY_S, **flags)
    env.r.config_set("hz", 50)              # expire lapsed keys promptly for the memory check
    baseline = env.r.info("memory")["used_memory"]
    prompts = [f"soak {i}" for i in range(N_JOBS)]
    client = env.client(dedupe_ttl_s=RESULT_TTL_S)
    jobs = [f"s{i}" for i in range(N_JOBS)]
    size = N_JOBS // WAVES
    follower = StreamFollower(env, jobs)
    wave, deadline = 0, time.monotonic() + 180
    while len(follower.ended) < N_JOBS:
        if wave < WAVES and victim.due(wave):
            part = slice(wave * size, (wave + 1) * size)
            client.submit_many([{"prompt": p, "job_id": j}
                                for p, j in zip(prompts[part], jobs[part])],
                               max_tokens=MAX_TOKENS, temperature=0.0)
            wave += 1
        follower.poll()
        victim.tick()
        assert time.monotonic() < deadline, (
            f"{N_JOBS - len(follower.ended)} jobs open after {victim.kills} kills; "
            f"pending {pending_summary(env.r, env.keys)[:5]}")
        time.sleep(0.2)
    assert victim.kills >= WAVES - 1, f"the soak ended after only {victim.kills} kills"
    bad = {j: p for j, prompt in zip(jobs, prompts) if (p := follower.problems(j, prompt))}
    assert not bad, (f"{len(bad)} broken streams, e.g. {dict(list(bad.items())[:3])}; first: "
                     f"{follower.describe(next(iter(bad)))}" if bad else "")
    assert all(follower.events[j][-1].type == "done" for j in jobs)
    wait_for(lambda: not pending_summary(env.r, env.keys), 15, what="nothing pending")
    assert all(env.r.xlen(lane) == 0 for lane in env.keys.lanes())
    assert not env.r.exists(env.keys.dead()), "a job was dead-lettered"
    try:
        wait_for(lambda: not per_job_keys(env), RESULT_TTL_S + 20, interval=0.5,
                 what="every result stream, dedupe record and owner record expired")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; left: {per_job_keys(env)}") from None
    used = env.r.info("memory")["used_memory"]
    assert used < baseline + 512 * 1024, f"used_memory {used} vs baseline {baseline}"
