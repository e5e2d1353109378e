"""Fleet benchmark: how much one Redis carries as fake-engine workers are added.

``python -m worker.bench_fleet [--workers 1,2,4,8] [--jobs 2000] [--max-tokens 32]``

For each fleet size: a private redis-server, that many ``python -m worker --model fake:``
processes (the FakeEngine: no model, tokens as fast as the service can move them), all jobs
submitted at once with ``submit_many`` (streamed, one token event per token), and the clock
stopped when the consumer group has acked every job (a job is acked only after its terminal
event is written). Printed: jobs/s, token events/s, and the CPU the redis-server and the workers
used per wall second (cores), which says where the fleet saturates: Redis near one core means
Redis is the bound (it runs commands on one thread); workers at the machine's cores means the
host is.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Any

import redis

from producer_sdk import Client
from producer_sdk.protocol import GROUP, Keys
from worker.redis_server import RedisServer


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _acked_all(r: redis.Redis, keys: Keys) -> bool:
    for lane in keys.lanes():
        if not r.exists(lane):
            continue
        for g in r.xinfo_groups(lane):
            name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
            if name == GROUP and (g.get("pending") or g.get("lag")):
                return False
    return True


def run_fleet(n_workers: int, jobs: int, max_tokens: int, max_num_seqs: int) -> dict[str, Any]:
    server = RedisServer().start()
    procs: list[subprocess.Popen] = []
    try:
        for i in range(n_workers):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "worker", "--model", f"fake:max_num_seqs={max_num_seqs}",
                 "--redis-url", server.url, "--worker-id", f"fleet-{i}", "--log-level",
                 "warning", "--block-ms", "20"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        keys = Keys()
        r = redis.Redis.from_url(server.url)
        deadline = time.monotonic() + 60
        while r.zcard(keys.workers) < n_workers:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {r.zcard(keys.workers)} of {n_workers} workers started")
            time.sleep(0.1)
        cpu0 = {p.pid: _cpu_seconds(p.pid) for p in procs}
        redis_cpu0 = _cpu_seconds(server.proc.pid)
        with Client(server.url) as client:
            start = time.perf_counter()
            client.submit_many([f"fleet job {i}" for i in range(jobs)], max_tokens=max_tokens,
                               ignore_eos=True, temperature=0.0)
            while not _acked_all(r, keys):
                time.sleep(0.02)
            wall = time.perf_counter() - start
        workers_cpu = sum(_cpu_seconds(p.pid) - cpu0[p.pid] for p in procs)
        return {"workers": n_workers, "jobs_s": jobs / wall,
                "tokens_s": jobs * max_tokens / wall, "wall_s": wall,
                "redis_cores": (_cpu_seconds(server.proc.pid) - redis_cpu0) / wall,
                "worker_cores": workers_cpu / wall}
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)
        server.stop()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m worker.bench_fleet",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="1,2,4,8", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="per fake worker")
    args = ap.parse_args(argv)
    print(f"{args.jobs} jobs of {args.max_tokens} streamed tokens, fake engine "
          f"(max_num_seqs={args.max_num_seqs}), one redis-server; host cores: {os.cpu_count()}")
    print(f"{'workers':>7} {'jobs/s':>8} {'token events/s':>15} {'wall s':>7} "
          f"{'redis cores':>11} {'worker cores':>12}")
    for n in args.workers:
        f = run_fleet(n, args.jobs, args.max_tokens, args.max_num_seqs)
        print(f"{n:7d} {f['jobs_s']:8.1f} {f['tokens_s']:15.0f} {f['wall_s']:7.2f} "
              f"{f['redis_cores']:11.2f} {f['worker_cores']:12.2f}")


if __name__ == "__main__":
    main()
