"""How long ``Client.statuses`` of many ids holds Redis from everyone else.

    python -m benchmarks.statuses [--jobs 50000] [--chunks 256 1000000000]

Enqueues ``--jobs`` jobs and writes a ``done`` event to each one's result stream (as a worker
would: the status is then the dedupe record and the snapshot MULTI), then for each
chunk size (``producer_sdk.core.status.STATUS_CHUNK``; one at least the job count is the unchunked
read) reads every status once while a second connection PINGs in a loop, and prints the longest
single command Redis ran (SLOWLOG, the EXEC of a round's MULTI included), the longest PING
round trip seen meanwhile, and the call's wall time. A private redis-server is started on a
free port (``benchmarks.submit.PrivateRedis``) and killed after.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from typing import Any

import msgpack
import redis

import tokenrelay.producer_sdk.core.status as status_mod
from benchmarks.submit import PrivateRedis
from tokenrelay.producer_sdk.client import Client
from tokenrelay.protocol.keys import EVENT_FIELD


def _ping_loop(port: int, stop: Any, worst_us: Any) -> None:
    r = redis.Redis(port=port)
    while not stop.is_set():
        t0 = time.perf_counter()
        r.ping()
        worst_us.value = max(worst_us.value, int((time.perf_counter() - t0) * 1e6))
        time.sleep(0.0005)


class PingProbe:
    """PINGs in a loop on its own connection, in another process (a thread would measure this
    process's GIL, not Redis); the longest round trip it saw."""

    def __init__(self, port: int) -> None:
        self.stop = multiprocessing.Event()
        self.worst = multiprocessing.Value("q", 0)
        self.proc = multiprocessing.Process(target=_ping_loop, args=(port, self.stop,
                                                                     self.worst), daemon=True)

    def start(self) -> None:
        self.proc.start()
        time.sleep(0.5)                 # connected and looping before the measured call

    def join(self) -> None:
        self.stop.set()
        self.proc.join(10)

    @property
    def worst_ms(self) -> float:
        return self.worst.value / 1000


def finish(r: redis.Redis, result_keys: list[str]) -> None:
    """A done event on every job's result stream, 1,000 per pipeline."""
    event = {EVENT_FIELD: msgpack.packb({"type": "done", "finish_reason": "stop", "text": ""},
                                        use_bin_type=True)}
    for at in range(0, len(result_keys), 1000):
        pipe = r.pipeline(transaction=False)
        for key in result_keys[at:at + 1000]:
            pipe.xadd(key, event)
        pipe.execute()


def measure(client: Client, admin: redis.Redis, port: int, ids: list[str],
            chunk: int) -> dict[str, float]:
    status_mod.STATUS_CHUNK = chunk
    admin.slowlog_reset()
    probe = PingProbe(port)
    probe.start()
    t0 = time.perf_counter()
    found = client.statuses(ids)
    wall = time.perf_counter() - t0
    probe.join()
    assert len(found) == len(ids)
    longest = max((e["duration"] for e in admin.slowlog_get(100_000)), default=0) / 1000
    return {"chunk": chunk, "longest_command_ms": longest, "worst_ping_ms": probe.worst_ms,
            "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=50_000)
    ap.add_argument("--chunks", type=int, nargs="+", default=[10**9, 128])
    args = ap.parse_args()
    server = PrivateRedis()
    try:
        admin = redis.Redis(port=server.port)
        admin.config_set("slowlog-log-slower-than", 1000)     # microseconds
        admin.config_set("slowlog-max-len", 100_000)
        with Client(server.url, queue="bench", max_queued_jobs=0) as client:
            jobs = client.submit_many([f"p{i}" for i in range(args.jobs)], max_tokens=4)
            ids = [j.id for j in jobs]
            finish(admin, [j.state.key for j in jobs])
            for chunk in args.chunks:
                row = measure(client, admin, server.port, ids, chunk)
                label = "unchunked" if chunk >= args.jobs else f"chunks of {chunk}"
                print(f"{args.jobs} statuses, {label}: longest command "
                      f"{row['longest_command_ms']:.1f} ms, worst concurrent PING "
                      f"{row['worst_ping_ms']:.1f} ms, call {row['wall_s']:.2f} s")
        admin.close()
    finally:
        server.close()


if __name__ == "__main__":
    main()
