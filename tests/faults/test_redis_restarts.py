"""A single Redis restarted under a streaming worker (issue #25, the worker half).

1. From an AOF that lost the last acknowledged step (``appendfsync everysec`` and a power cut,
   simulated: the AOF directory is copied right after one step landed, the worker writes the
   next one, Redis is SIGKILLed and restarted on the same port from the older copy). Every other
   round the worker is stopped (SIGSTOP) across the restart, as if it fit inside one engine step,
   so its pooled connection reconnects silently and it sees no error: only the check of every
   write (the stream's length, protocol/scripts/results.py) finds the loss; in the others it
   may see the outage (on a loaded host the restart outlasts the fake engine's ``STEP_S``).
   Repeated until the loss happened several times: every stream exact, every later
   ``Client.get(id).result()`` equal to the live text, ``usage.completion_tokens`` equal to the
   token ids.
2. Without its data, while sampled jobs (temperature > 0, no seed) stream: the worker ends
   them without recreating anything (a fresh seed beside what readers hold would mix two
   samples); the readers, who hold the request, enqueue them again with the seed they saw.
"""

from __future__ import annotations

import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from tests.fault_harness import FaultEnv, check_stream, wait_for
from tokenrelay.worker.fake_engine import fake_completion

STEP_S = 0.3          # fake engine step: the quiet window the restart must fit in
TOKENS = 14
JOBS = 6              # a round's jobs, and the worker's batch: full, it keeps no blocking read
                      # for new jobs outstanding, whose lost connection it would log


class Reader(threading.Thread):
    """Streams one job to its end; keeps the text seen, and what ``result()`` said or raised."""

    def __init__(self, job: Any) -> None:
        super().__init__(daemon=True)
        self.job, self.parts, self.result, self.error = job, [], None, None

    def run(self) -> None:
        try:
            for d in self.job.stream(timeout=90):
                self.parts.append(d.text)
            self.result = self.job.result(timeout=10)
        except BaseException as exc:     # checked by the test
            self.error = exc

    @property
    def text(self) -> str:
        return "".join(self.parts)


def lengths(env: FaultEnv, job_ids: list[str]) -> dict[str, int]:
    pipe = env.r.pipeline(transaction=False)
    for j in job_ids:
        pipe.xlen(env.keys.results(j))
    return dict(zip(job_ids, pipe.execute()))


def next_step_landed(env: FaultEnv, job_ids: list[str], timeout: float = 10.0) -> dict[str, int]:
    """Poll until some stream grew (a step's flush landed); the lengths right after it."""
    before = lengths(env, job_ids)
    return wait_for(lambda: (now := lengths(env, job_ids)) != before and now, timeout,
                    interval=0.005, what="the next step's writes")


def restore_after_kill(env: FaultEnv, snapshot: Path, frozen: Optional[Any] = None) -> None:
    """SIGKILL Redis and start it on the same port from the AOF copied before (the power cut
    lost everything written since). ``frozen``: a worker stopped (SIGSTOP) until Redis serves
    again, so the restart fits between two of its commands however slow the host: it sees no
    error, only the writes' check can find the loss."""
    aof = env.redis.dir / "appendonlydir"
    if frozen is not None:
        frozen.signal(signal.SIGSTOP)
    try:
        env.redis.kill()
        shutil.rmtree(aof)
        shutil.copytree(snapshot, aof)
        env.redis.start()
    finally:
        if frozen is not None:
            frozen.signal(signal.SIGCONT)


REDIS_ERROR_LOGS = ("redis connection lost", "lost its connection", "redis command failed",
                    "will retry")


@pytest.mark.timeout(420)
def test_a_restart_that_lost_the_last_step_is_found_and_resumed(tmp_path):
    env = FaultEnv(tmp_path, namespace="aofl",
                   redis_args=("--appendonly", "yes", "--appendfsync", "everysec"))
    try:
        w = env.worker("w1", delay=STEP_S, max_num_seqs=JOBS, lease_ms=5000)
        client = env.client()
        hits, silent, rounds = 0, 0, 0
        readers: dict[str, Reader] = {}
        prompts: dict[str, str] = {}
        while (hits < 3 or silent < 2) and rounds < 12:
            rounds += 1
            jobs = {f"round {rounds} job {i}": None for i in range(JOBS)}
            for prompt in jobs:
                job = client.submit(prompt, max_tokens=TOKENS, temperature=0)
                prompts[job.id], readers[job.id] = prompt, Reader(job)
                readers[job.id].start()
            ids = list(prompts)[-len(jobs):]
            wait_for(lambda: min(lengths(env, ids).values()) >= 4, 30, what="tokens flowing")
            next_step_landed(env, ids)
            snapshot = tmp_path / f"aof-{rounds}"
            shutil.copytree(env.redis.dir / "appendonlydir", snapshot)
            acked = next_step_landed(env, ids)      # a step the copy does not hold
            log_at = len(w.log())
            restore_after_kill(env, snapshot, frozen=w if rounds % 2 else None)
            survived = lengths(env, ids)
            if any(survived[j] < acked[j] for j in ids):
                hits += 1
                for j in ids:
                    readers[j].join(120)
                silent += not any(s in w.log()[log_at:] for s in REDIS_ERROR_LOGS)
        assert hits >= 3 and silent >= 2, (hits, silent, rounds, env.logs())
        for job_id, rd in readers.items():
            rd.join(120)
            assert rd.error is None, (job_id, rd.error)
            rep = check_stream(env.r, env.keys, job_id)
            assert rep.problems == [] and rep.kind == "done:length", (job_id, rep.problems)
            want = fake_completion(prompts[job_id], TOKENS)
            later = env.client().get(job_id).result(timeout=10)
            assert later.text == rd.text == rd.result.text == rep.text == want, job_id
            assert later.usage.completion_tokens == len(later.token_ids) == TOKENS, job_id
        assert "resuming from what the stream holds" in w.log()
    finally:
        env.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("down_s", [0.0, 1.5], ids=["quiet", "seen"])
def test_a_restart_without_data_never_mixes_two_samples(tmp_path, down_s):
    """Sampled jobs (temperature > 0, no seed) stream when Redis comes back empty, at once (the
    worker may see no error) or after ``down_s`` (its writes fail first). The worker must not
    write anything more for them (a resume from an empty stream would draw a new seed and its
    tokens would follow the first run's in the readers' folds); the readers that hold the
    request enqueue it again with the seed they saw, so each ends with exactly the first run's
    sample; a reader that only has the id ends job_lost. Within seconds, each once."""
    from tokenrelay.producer_sdk.errors import JobFailed
    from tests.fault_harness import read_events
    env = FaultEnv(tmp_path, namespace="nodata")
    try:
        w = env.worker("w1", delay=0.1, max_num_seqs=16)
        client = env.client()
        prompts = [f"sampled {i}" for i in range(6)]
        jobs = [client.submit(p, max_tokens=40, temperature=0.8) for p in prompts]
        readers = [Reader(j) for j in jobs]
        unread = env.client().submit("read by id only", max_tokens=40, temperature=0.8)
        by_id = Reader(env.client().get(unread.id))     # no reader holds its request
        for rd in readers + [by_id]:
            rd.start()
        wait_for(lambda: all(len(rd.parts) >= 5 for rd in readers), 60, what="every reader reading")
        seeds = {j.id: read_events(env.r, env.keys, j.id)[0].seed for j in jobs}
        env.redis.restart(down_for=down_s)         # no persistence: everything is gone
        restarted = time.monotonic()
        for rd in readers + [by_id]:
            rd.join(120)
        assert time.monotonic() - restarted < 60
        assert isinstance(by_id.error, JobFailed) and by_id.error.code == "job_lost", by_id.error
        for prompt, job, rd in zip(prompts, jobs, readers):
            want = fake_completion(prompt, 40, seed=seeds[job.id], greedy=False)
            assert rd.error is None, (job.id, rd.error)
            assert rd.text == rd.result.text == want, job.id      # one sample, each token once
            assert job.state.reruns >= 1, job.id
            rep = check_stream(env.r, env.keys, job.id)          # the rerun's stream
            assert rep.problems == [] and {s.seed for s in rep.started} == {seeds[job.id]}
        log = w.log()
        for job in jobs:                                          # ended on the worker, once
            lines = [x for x in log.splitlines() if job.id in x and "dropped" in x]
            assert len(lines) <= 1, lines
    finally:
        env.close()


@pytest.mark.timeout(180)
def test_a_restart_that_lost_finished_jobs_ends_them_again_within_seconds(tmp_path):
    """The AOF lost the end of jobs that had finished and been acknowledged: their entries are
    pending under the worker again, which no longer holds them, and their streams lack the
    last tokens and the done event. A long job keeps the worker busy and the restart fits in
    one of its steps, so the worker may see no error: it notices the restart by the server's
    run id and re-reads its own pending entries at once, not after the lease (30 s here).
    Every later ``result()`` is the full text the live readers had."""
    env = FaultEnv(tmp_path, namespace="aofd",
                   redis_args=("--appendonly", "yes", "--appendfsync", "everysec"))
    try:
        w = env.worker("w1", delay=STEP_S, max_num_seqs=16, lease_ms=30_000)
        client = env.client()
        long_job = client.submit("keeps the worker busy", max_tokens=400, temperature=0)
        readers = {}
        for p in (f"finished {i}" for i in range(4)):
            readers[p] = Reader(client.submit(p, max_tokens=TOKENS, temperature=0))
            readers[p].start()
        ids = [rd.job.id for rd in readers.values()]
        wait_for(lambda: min(lengths(env, ids).values()) >= 4, 30, what="tokens flowing")
        snapshot = tmp_path / "aof-mid"
        shutil.copytree(env.redis.dir / "appendonlydir", snapshot)
        for rd in readers.values():
            rd.join(60)
        wait_for(lambda: env.r.xlen(env.keys.lane("default")) == 1, 10, what="the short acked")
        next_step_landed(env, [long_job.id])
        log_at = len(w.log())
        restore_after_kill(env, snapshot)
        restored = time.monotonic()
        assert not check_stream(env.r, env.keys, ids[0]).ended        # the done was lost
        for p, rd in readers.items():
            assert rd.error is None and rd.text == fake_completion(p, TOKENS), p
            later = env.client().get(rd.job.id).result(timeout=20)
            assert later.text == rd.text and later.usage.completion_tokens == TOKENS, p
            rep = check_stream(env.r, env.keys, rd.job.id)
            assert rep.problems == [] and rep.kind == "done:length", (p, rep.problems)
        assert time.monotonic() - restored < 15
        quiet = w.log()[log_at:]
        if not any(s in quiet for s in REDIS_ERROR_LOGS):
            assert "redis restarted" in quiet
    finally:
        env.close()
