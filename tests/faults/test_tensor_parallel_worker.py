"""Tensor-parallel workers (``--tensor-parallel-size 2``, CPU, gloo) through Redis, and the crash
story when a rank dies.

Two size-2 workers start at once (two rendezvous on one host) and stream greedy jobs equal to
the offline size-1 engine. Rank 1 of the worker holding the most jobs is SIGKILLed mid-stream:
that worker exits at once with one log line naming the rank, the other worker reclaims and
resumes its jobs, every stream holds each token exactly once, and no rank process outlives its
worker (also when the worker is stopped with SIGTERM to its process group and drains).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.fault_harness import (assert_resumed_like_offline, child_pids, log_events,
                                 wait_for)


def rank_pids(parent: int) -> list[int]:
    """Pids of the tensor-parallel ranks (``python -m tokenrelay.engine.parallel.rank``) of ``parent``."""
    return child_pids(parent, b"tokenrelay.engine.parallel.rank")


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (ProcessLookupError, OSError):
        return True
    return state == "Z"


def failure_lines(log: str) -> list[dict]:
    return log_events(log, "tensor-parallel engine")


@pytest.mark.timeout(240)
def test_killed_rank_ends_its_worker_and_another_resumes_its_jobs_exactly_once(
        env, tiny_checkpoint):
    model = str(tiny_checkpoint("llama"))
    flags = {"max-num-seqs": 32, "dtype": "float32", "tensor-parallel-size": 2,
             "tensor-parallel-timeout-s": 60}       # not FAST_FLAGS' 1 s lease on a busy host
    workers = {wid: env.worker(wid, model=model, wait=False, **flags) for wid in ("w1", "w2")}
    for w in workers.values():                      # both size-2 engines start at once
        w.wait_for_log("worker ready", timeout=180)
    ranks = {wid: rank_pids(w.pid) for wid, w in workers.items()}
    assert all(len(pids) == 1 for pids in ranks.values()), ranks
    texts = [f"tensor parallel job {i} says hello" for i in range(16)]
    params = dict(max_tokens=48, temperature=0.0, ignore_eos=True)
    jobs = env.submit(texts, **params)
    wait_for(lambda: env.tokens_streamed(jobs) >= 16 * 6, 90, what="tokens flowing")
    victim = max(workers, key=lambda wid: len(env.held_by(wid)))
    survivor = "w2" if victim == "w1" else "w1"
    held = env.held_by(victim)
    os.kill(ranks[victim][0], signal.SIGKILL)       # rank 1, mid-stream
    killed_at = time.monotonic()
    assert workers[victim].wait(timeout=30) == 1
    exit_s = time.monotonic() - killed_at
    lines = failure_lines(workers[victim].log())
    assert len(lines) == 1, workers[victim].log()[-3000:]
    assert "rank 1" in lines[0]["cause"] and "SIGKILL" in lines[0]["cause"], lines[0]

    reports = env.wait_ended(jobs, timeout=150)
    env.assert_exactly_once(reports)
    from tokenrelay.engine.llm import LLM
    from tokenrelay.engine.sampling_params import SamplingParams
    offline = LLM(model, device="cpu", dtype="float32").generate(texts, SamplingParams(**params))
    resumed = assert_resumed_like_offline(reports, jobs, offline, held, survivor)
    print(f"\nworker exited {exit_s:.2f} s after its rank 1 was killed; "
          f"{len(resumed)} jobs resumed by {survivor}")

    # The survivor stopped as a supervisor stops it (SIGTERM to its process group, ranks
    # included): the ranks leave it the drain, and end when it exits.
    survivor_rank = ranks[survivor][0]
    os.killpg(workers[survivor].pid, signal.SIGTERM)
    assert workers[survivor].wait(timeout=60) == 0
    wait_for(lambda: gone(survivor_rank), 10, what="the stopped worker's rank to exit")


@pytest.mark.timeout(240)
def test_a_frozen_rank_ends_its_worker_within_the_lease(env, tiny_checkpoint):
    """Rank 1 SIGSTOPped mid-stream (frozen, not dead: its sockets stay open) fails the
    group's next collective after half the worker's lease (--tensor-parallel-timeout-s unset),
    so the worker exits within its lease with one line naming the failure instead of holding its
    jobs for gloo's 120 s (issue #42: 122 s); its stopped rank does not outlive it."""
    model = str(tiny_checkpoint("llama"))
    lease_s = 8
    worker = env.worker("w1", model=model, wait=False, **{
        "max-num-seqs": 8, "dtype": "float32", "tensor-parallel-size": 2,
        "lease-ms": lease_s * 1000})
    worker.wait_for_log("worker ready", timeout=180)
    rank = rank_pids(worker.pid)
    assert len(rank) == 1, rank
    jobs = env.submit([f"frozen rank job {i}" for i in range(4)], max_tokens=400,
                      temperature=0.0, ignore_eos=True)
    try:
        wait_for(lambda: env.tokens_streamed(jobs) >= 4 * 4, 90, what="tokens flowing")
        os.kill(rank[0], signal.SIGSTOP)
        frozen_at = time.monotonic()
        assert worker.wait(timeout=lease_s + 30) == 1, worker.log()[-3000:]
        exit_s = time.monotonic() - frozen_at
        assert exit_s < lease_s, exit_s
        lines = failure_lines(worker.log())
        assert len(lines) == 1, worker.log()[-3000:]
        wait_for(lambda: gone(rank[0]), 15, what="the frozen rank to end with its worker")
        print(f"\nworker exited {exit_s:.2f} s after its rank 1 froze (lease {lease_s} s): "
              f"{lines[0]['cause'][:200]}")
    finally:
        if not gone(rank[0]):
            os.kill(rank[0], signal.SIGKILL)
