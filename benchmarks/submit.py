"""Submission-rate benchmark: ``Client.submit_many`` vs a bare redis-py pipelined XADD loop.

    python -m benchmarks.submit [--jobs 100000] [--redis-url URL] [--rounds 2]

Both sides enqueue the same payloads in the same run. The bare loop gets them pre-encoded (the
least work an XADD loop can do); the SDK builds and validates them itself, adds the dedupe
record, the token cost and the back-pressure checks (a token budget is set, large enough for
every job: the admission runs, nothing is refused). Without --redis-url a private redis-server
is started on a free port (and killed after); with one, a fresh namespace is used and deleted
afterwards.

Besides jobs/s it prints where the time goes, per job and per side: this process's CPU time
(``time.process_time``) and the Redis server's (``INFO cpu``, user + sys; only meaningful with
the private server, which does nothing else). On a machine shared with other work the
throughput figures move with the load; the CPU figures much less.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import msgpack
import redis

from tokenrelay.producer_sdk.client import Client
from tokenrelay.protocol.keys import Keys, PAYLOAD_FIELD
from tokenrelay.protocol.wire import now_ms

SAMPLING = {"max_tokens": 16, "temperature": 0.7}
BARE_PIPELINE = 1000


class PrivateRedis:
    """redis-server without persistence on a free port; removed on exit."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server not found; pass --redis-url to use a running Redis")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.dir = tempfile.mkdtemp(prefix="tokenrelay-bench-")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self.dir], stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        r = redis.Redis(port=self.port)
        for _ in range(200):
            try:
                r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
        r.close()

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


class Measured:
    """Wall time, this process's CPU time and the Redis server's CPU time of one run."""

    def __init__(self, r: redis.Redis) -> None:
        self.r = r

    def _server_cpu(self) -> float:
        info = self.r.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def __enter__(self) -> "Measured":
        self.server0, self.cpu0, self.t0 = self._server_cpu(), time.process_time(), \
            time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall = time.perf_counter() - self.t0
        self.cpu = time.process_time() - self.cpu0
        self.server = self._server_cpu() - self.server0


def bare_rate(r: redis.Redis, key: str, payloads: list[bytes]) -> Measured:
    with Measured(r) as m:
        pipe = r.pipeline(transaction=False)
        for i, p in enumerate(payloads, 1):
            pipe.xadd(key, {PAYLOAD_FIELD: p})
            if i % BARE_PIPELINE == 0:
                pipe.execute()
        pipe.execute()
    return m


def sdk_rate(r: redis.Redis, client: Client, prompts: list[str]) -> Measured:
    client.ping()                       # the connection made outside the measured time
    with Measured(r) as m:
        jobs = client.submit_many(prompts, **SAMPLING)
    assert len(jobs) == len(prompts)
    return m


def delete_namespace(r: redis.Redis, namespace: str) -> None:
    batch = []
    for key in r.scan_iter(match=f"{namespace}:*", count=5000):
        batch.append(key)
        if len(batch) >= 5000:
            r.unlink(*batch)
            batch = []
    if batch:
        r.unlink(*batch)


def payloads_like_sdk(prompts: list[str]) -> list[bytes]:
    """The same protocol payloads the SDK sends (ids differ, sizes match)."""
    ts = now_ms()
    return [msgpack.packb({"v": 1, "job_id": f"j{os.urandom(8).hex()}-{i:x}", "prompt": p,
                           "params": SAMPLING, "priority": 0, "stream": True,
                           "submitted_ms": ts}, use_bin_type=True)
            for i, p in enumerate(prompts)]


def run(url: str, jobs: int, rounds: int) -> dict[str, Any]:
    r = redis.Redis.from_url(url)
    prompts = [f"Summarize item number {i} in one sentence." for i in range(jobs)]
    payloads = payloads_like_sdk(prompts)
    bare: list[Measured] = []
    sdk: list[Measured] = []
    for rnd in range(rounds):
        ns = f"bench{os.getpid()}r{rnd}"
        try:
            bare.append(bare_rate(r, Keys(ns + "bare").lane("default"), payloads))
            with Client(url, namespace=ns, max_queued_jobs=0,
                        max_queued_tokens=10**12) as client:
                sdk.append(sdk_rate(r, client, prompts))
        finally:
            delete_namespace(r, ns + "bare")
            delete_namespace(r, ns)
    r.close()
    best_bare, best_sdk = min(bare, key=lambda m: m.wall), min(sdk, key=lambda m: m.wall)

    def us(seconds: float) -> float:
        return seconds / jobs * 1e6
    return {"jobs": jobs, "bare_xadd_per_s": jobs / best_bare.wall,
            "sdk_submit_many_per_s": jobs / best_sdk.wall, "ratio": best_bare.wall / best_sdk.wall,
            "rounds": rounds,
            "bare_us_per_job": {"client_cpu": us(min(m.cpu for m in bare)),
                                "redis_cpu": us(min(m.server for m in bare))},
            "sdk_us_per_job": {"client_cpu": us(min(m.cpu for m in sdk)),
                               "redis_cpu": us(min(m.server for m in sdk))}}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.submit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds; best of each side")
    p.add_argument("--redis-url", default=None,
                   help="use this Redis (a throwaway namespace) instead of a private server")
    args = p.parse_args(argv)
    server = None if args.redis_url else PrivateRedis()
    try:
        url = args.redis_url or server.url
        print(f"redis: {url if args.redis_url else 'private redis-server ' + url}; "
              f"{args.jobs} jobs x {args.rounds} rounds", file=sys.stderr)
        res = run(url, args.jobs, args.rounds)
    finally:
        if server is not None:
            server.close()
    print(f"bare redis-py pipelined XADD : {res['bare_xadd_per_s']:>10,.0f} jobs/s")
    print(f"Client.submit_many           : {res['sdk_submit_many_per_s']:>10,.0f} jobs/s")
    print(f"ratio                        : {res['ratio']:.2f} (target >= 0.80)")
    for side, name in (("bare", "bare XADD"), ("sdk", "submit_many")):
        t = res[f"{side}_us_per_job"]
        print(f"{name:<12} CPU per job      : client {t['client_cpu']:.2f} us, redis-server "
              f"{t['redis_cpu']:.2f} us (least of the rounds)")
    return 0 if res["ratio"] >= 0.8 else 1


if __name__ == "__main__":
    sys.exit(main())
