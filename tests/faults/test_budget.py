"""The token budget through worker kills: thousands of jobs (ordinary, cancelled, expired, one
poison) through two ``--model fake:`` workers while one is SIGKILLed and restarted every
second; the jobs go in four waves, each after a kill once the restart is ready, so at least three
kills land mid-stream however fast the host is. Each job's cost is released exactly once, by
the script writing its one terminal event (or its dead letter), so the counter never goes below
zero and ends at exactly zero: no kill releases a job twice or loses its release."""

from __future__ import annotations

import time

import pytest

from tokenrelay.protocol.keys import EVENT_FIELD
from tokenrelay.protocol.wire import decode_event
from tests.fault_harness import FaultEnv, RepeatedKills, pending_summary, wait_for

N_JOBS = 2000
WAVES = [range(i, i + N_JOBS // 4) for i in range(0, N_JOBS, N_JOBS // 4)]   # next after a kill
FLAGS = dict(max_num_seqs=32, max_deliveries=2, delay=0.02)
INJECT = {"TOKENRELAY_FAULT_INJECT": "raise_on_prompt:POISON"}


def submit_wave(client, wave: range, ids: list[str], admitted: int) -> tuple[list[str], int]:
    """One wave of ordinary jobs, a tenth of them cancelled before a worker reads them, and ten
    that expire first; the last wave also carries the poison job. The ids so far and the tokens
    the budget admitted, both grown by this wave."""
    new = [f"b{i}" for i in wave]
    jobs = client.submit_many([{"prompt": f"budget {i}", "job_id": j} for i, j in zip(wave, new)],
                              max_tokens=8, temperature=0.0)
    admitted += sum(j.request.cost for j in jobs)
    for j in new[::10]:
        client.cancel(j)
    late = client.submit_many([{"prompt": f"late {i}", "job_id": f"e{i}"}
                               for i in wave[::len(wave) // 10]],
                              max_tokens=8, deadline_s=0.001)
    admitted += sum(j.request.cost for j in late)
    new += [j.id for j in late]
    if wave.stop == N_JOBS:
        new.append(client.submit("this is POISON", max_tokens=8, job_id="poison").id)
    return ids + new, admitted


def ended(env: FaultEnv, job_ids: list[str]) -> set[str]:
    """The jobs whose result stream ends with a terminal event."""
    pipe = env.r.pipeline(transaction=False)
    for j in job_ids:
        pipe.xrevrange(env.keys.results(j), count=1)
    out = set()
    for j, last in zip(job_ids, pipe.execute()):
        if last and decode_event(last[0][1][EVENT_FIELD]).type in ("done", "error"):
            out.add(j)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_budget_back_at_exactly_zero_after_thousands_of_jobs_and_worker_kills(env):
    steady = env.worker("w1", env=INJECT, **FLAGS)
    victim = RepeatedKills(env, "w2", may_die=True, env=INJECT, **FLAGS)   # poison kills it too
    client = env.client(max_queued_tokens=10**9)         # the budget on; room for all
    ids, admitted, wave, done = [], 0, 0, set()
    deadline = time.monotonic() + 240
    while wave < len(WAVES) or len(done) < len(ids):
        if wave < len(WAVES) and victim.due(wave):
            ids, admitted = submit_wave(client, WAVES[wave], ids, admitted)
            wave += 1
        used = int(env.r.get(env.keys.budget()) or 0)
        assert 0 <= used <= admitted + 10_000, f"budget counter {used}"
        done |= ended(env, [j for j in ids if j not in done])
        if steady.proc.poll() is not None:             # the poison job crashed it
            steady = env.worker("w1", env=INJECT, wait=False, **FLAGS)
        victim.tick()
        assert time.monotonic() < deadline, (
            f"{len(ids) - len(done)} jobs open after {victim.kills} kills; budget {used}; "
            f"pending {pending_summary(env.r, env.keys)[:5]}\n{env.logs()[-3000:]}")
        time.sleep(0.2)
    assert victim.kills >= len(WAVES) - 1, f"only {victim.kills} kills"
    reports = env.streams(ids)
    kinds = {rep.kind for rep in reports.values()}
    assert {"error:poison", "error:expired", "done:cancelled", "done:length"} <= kinds, kinds
    env.assert_exactly_once(reports)
    wait_for(lambda: not pending_summary(env.r, env.keys), 15, what="nothing pending")
    assert int(env.r.get(env.keys.budget()) or 0) == 0


@pytest.mark.timeout(120)
def test_the_batch_runner_waits_for_budget_room(env, tmp_path):
    """A batch whose jobs do not all fit the budget: the runner waits for room (as for the
    job-count bound), every line is answered, the budget is never exceeded and ends at 0."""
    import json
    import threading

    from tokenrelay.producer_sdk.batch.runner import BatchRunner
    env.worker("w1", max_num_seqs=4)
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    inp.write_text("".join(json.dumps({
        "custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
        "body": {"model": "fake", "prompt": f"p{i}", "max_tokens": 4, "temperature": 0}})
        + "\n"
        for i in range(40)))                         # each costs 1 + 4 tokens
    seen, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            seen[0] = max(seen[0], int(env.r.get(env.keys.budget()) or 0))
            time.sleep(0.005)
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        client = env.client(max_queued_tokens=12)      # two jobs at a time
        summary = BatchRunner(client, inp, out, err, batch_id="bb", concurrency=16,
                              progress=False).run()
    finally:
        stop.set()
        watcher.join()
    assert summary.succeeded == 40
    assert not err.exists() or not err.read_text().strip()
    assert 0 < seen[0] <= 12
    wait_for(lambda: int(env.r.get(env.keys.budget()) or 0) == 0, 10, what="budget back at 0")
