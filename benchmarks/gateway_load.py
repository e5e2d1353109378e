"""Gateway load: thousands of concurrent streams through one gateway, held and abandoned, with
ordinary requests beside them.

``python -m benchmarks.gateway_load [--streams 2000] [--abandon 0.5] [--workers 2]
[--ordinary 200] [--reader-wake on|off|both] [--idle 500] [--resume-grace-s 0] [--json FILE]``

Starts a private redis-server, ``--workers`` ``tokenrelay worker --model fake:`` processes and
one ``tokenrelay gateway``; opens ``--streams`` streamed completions at once, of
which the ``--abandon`` fraction leave after 3 chunks of a 2000-token job and the rest read
their ``--held-tokens`` to the end; once every stream has its headers, ``--ordinary``
non-streamed requests (8 tokens) go in beside the held ones at ``--ordinary-rate`` per second. Printed: answers by status (no 5xx is the target),
time to first chunk of the held streams (and the workers' own, from enqueue), latency of the ordinary requests (p50 / p99), for
each abandoned job the tokens generated after its client read its last chunk (a fake engine
makes one token per job per step: the steps its cancel took; the gateway runs with ``--resume-grace-s 0`` unless told otherwise,
since under a grace an abandoned stream is parked, not cancelled, and the figure would be the
grace), the gateway's peak RSS and its
peak Redis connections, Redis commands/s, the gateway's own time to first token (from the
request's arrival, its histogram), the CPU seconds each process used (the host is shared:
on a small one the client, gateway, workers and Redis compete for the cores). Then an idle phase: ``--idle`` streams wait in a
queue no worker serves (``X-Wait-For-Worker``) for 5 s: Redis commands/s and gateway CPU
while nothing happens, the price of the shared readers' blocking (wake streams) or slicing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx
import psutil
import redis

from tokenrelay.protocol.keys import EVENT_FIELD, Keys
from tokenrelay.protocol.wire import decode_event
from devtools.redis_server import RedisServer, free_port

NS, QUEUE = "load", "loadq"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Stack:
    """The processes of one run: Redis, workers, the gateway."""

    server: RedisServer
    workers: list[subprocess.Popen] = field(default_factory=list)
    gateway: Optional[subprocess.Popen] = None
    url: str = ""

    def stop(self) -> None:
        for p in [*self.workers, self.gateway]:
            if p is not None and p.poll() is None:
                p.terminate()
        for p in [*self.workers, self.gateway]:
            if p is not None:
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
        self.server.stop()


def start_stack(args: argparse.Namespace, wake: bool) -> Stack:
    server = RedisServer(["--appendonly", "no"]).start()
    stack = Stack(server)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENRELAY_")}
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    for i in range(args.workers):
        stack.workers.append(subprocess.Popen([
            sys.executable, "-m", "tokenrelay.worker", "--model",
            f"fake:max_num_seqs={args.max_num_seqs},step_delay={args.step_delay}",
            "--redis-url", server.url, "--namespace", NS, "--queue", QUEUE, "--worker-id",
            f"w{i}", "--log-level", "warning"], **quiet))
    port = free_port()
    stack.url = f"http://127.0.0.1:{port}"
    stack.gateway = subprocess.Popen([
        sys.executable, "-m", "tokenrelay.producer_sdk.gateway", "--redis-url", server.url, "--namespace",
        NS, "--port", str(port), "--log-level", "warning", "--routes", "idle=idleq",
        "--max-in-flight", "8192", "--resume-grace-s", str(args.resume_grace_s), "--reader-wake" if wake else "--no-reader-wake"], **quiet)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{stack.url}/v1/models", timeout=2).json().get("data"):
                return stack
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    stack.stop()
    raise RuntimeError("the gateway or the workers did not come up")


class Sampler(threading.Thread):
    """Peak gateway RSS, peak gateway connections to Redis, Redis commands and the gateway's
    CPU, sampled every 0.1 s."""

    def __init__(self, stack: Stack) -> None:
        super().__init__(daemon=True)
        self.proc = psutil.Process(stack.gateway.pid)
        self.redis_port = stack.server.port
        self.r = redis.Redis(port=stack.server.port)
        self.stopping = threading.Event()
        self.rss = 0
        self.conns = 0

    def commands(self) -> int:
        return int(self.r.info("stats")["total_commands_processed"])

    def cpu(self) -> float:
        t = self.proc.cpu_times()
        return t.user + t.system

    def run(self) -> None:
        while not self.stopping.is_set():
            self.rss = max(self.rss, self.proc.memory_info().rss)
            conns = [c for c in self.proc.net_connections("tcp")
                     if c.raddr and c.raddr.port == self.redis_port]
            self.conns = max(self.conns, len(conns))
            time.sleep(0.1)


async def held(client: httpx.AsyncClient, url: str, i: int, tokens: int,
               opened: list[int]) -> tuple[int, tuple[float, str]]:
    """Read to the end: (status, (time to the first chunk, job id))."""
    t0 = time.monotonic()
    first = float("nan")
    body = {"model": "fake", "prompt": f"held {i}", "max_tokens": tokens, "stream": True}
    async with client.stream("POST", url, json=body) as resp:
        opened[0] += 1
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and first != first:
                first = time.monotonic() - t0
    return resp.status_code, (first, resp.headers.get("x-job-id", ""))


def histogram_quantile(metrics: str, name: str, q: float) -> float:
    """The upper bound of the Prometheus histogram bucket holding quantile ``q``."""
    buckets = []
    for line in metrics.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return float("nan")
    total = buckets[-1][1]
    return next(le for le, count in buckets if count >= q * total)


def cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def worker_ttft(r: redis.Redis, job_ids: list[str]) -> list[float]:
    """The workers' own time to first token of these jobs (from enqueue, their ``done``
    event's timings): what the gateway's figure would be if it added nothing."""
    keys = Keys(NS, QUEUE)
    out = []
    for job_id in job_ids:
        last = r.xrevrange(keys.results(job_id), count=1)
        if last:
            event = decode_event(last[0][1][EVENT_FIELD])
            if event.type == "done" and event.timings.ttft_ms is not None:
                out.append(event.timings.ttft_ms / 1000)
    return out


async def abandoned(client: httpx.AsyncClient, url: str, i: int,
                    opened: list[int]) -> tuple[int, tuple[str, float]]:
    """Leave after 3 chunks: (status, (job id, when the connection was closed, epoch s))."""
    body = {"model": "fake", "prompt": f"left {i}", "max_tokens": 2000, "stream": True}
    async with client.stream("POST", url, json=body) as resp:
        opened[0] += 1
        if resp.status_code != 200:
            return resp.status_code, ("", 0.0)
        chunks = 0
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunks += 1
                if chunks == 3:
                    break
        job_id = resp.headers["x-job-id"]
    return 200, (job_id, time.time())


async def ordinary(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, float]:
    t0 = time.monotonic()
    resp = await client.post(url, json={"model": "fake", "prompt": f"plain {i}",
                                        "max_tokens": 8})
    return resp.status_code, time.monotonic() - t0


async def load(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    url = f"{stack.url}/v1/completions"
    n_left = int(args.streams * args.abandon)
    limits = httpx.Limits(max_connections=args.streams + args.ordinary + 100,
                          max_keepalive_connections=100)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        opened = [0]
        streams = [asyncio.create_task(abandoned(client, url, i, opened))
                   for i in range(n_left)]
        streams += [asyncio.create_task(held(client, url, i, args.held_tokens, opened))
                    for i in range(args.streams - n_left)]
        until = time.monotonic() + 120      # ordinary requests go in once every stream opened
        while opened[0] < args.streams and time.monotonic() < until:
            await asyncio.sleep(0.05)
        plain = []
        for i in range(args.ordinary):
            plain.append(asyncio.create_task(ordinary(client, url, i)))
            await asyncio.sleep(1 / args.ordinary_rate)
        done = await asyncio.gather(*streams, *plain)
    left, kept, plain_out = done[:n_left], done[n_left:args.streams], done[args.streams:]
    return {"left": left, "held": kept, "ordinary": plain_out}


def after_leaving(r: redis.Redis, left: list[tuple[str, float]]) -> list[int]:
    """Per abandoned job, the engine steps that still made a token for it after its client
    closed the connection (token events stamped later; -1: not cancelled). Waits for each
    job's terminal event."""
    keys = Keys(NS, QUEUE)
    out = []
    deadline = time.monotonic() + 60
    for job_id, gone in left:
        while True:
            events = [decode_event(f[EVENT_FIELD]) for _, f in r.xrange(keys.results(job_id))]
            if events and events[-1].type in ("done", "error"):
                cancelled = events[-1].type == "done" and events[-1].finish_reason == "cancelled"
                out.append(sum(1 for e in events if e.type == "token" and e.ts > gone)
                           if cancelled else -1)
                break
            if time.monotonic() > deadline:
                out.append(-1)
                break
            time.sleep(0.05)
    return out


async def idle_phase(stack: Stack, n: int, sampler: Sampler, seconds: float = 5.0) -> dict:
    """``n`` streams waiting for a worker that never comes: Redis commands/s and gateway CPU."""
    url = f"{stack.url}/v1/completions"
    headers = {"X-Wait-For-Worker": "true"}
    limits = httpx.Limits(max_connections=n + 10)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        async def wait_one(i: int) -> None:
            body = {"model": "idle", "prompt": f"idle {i}", "max_tokens": 4, "stream": True}
            async with client.stream("POST", url, json=body, headers=headers) as resp:
                async for _ in resp.aiter_lines():
                    pass
        tasks = [asyncio.create_task(wait_one(i)) for i in range(n)]
        await asyncio.sleep(2.0)                     # all waiting
        c0, cpu0, t0 = sampler.commands(), sampler.cpu(), time.monotonic()
        await asyncio.sleep(seconds)
        dt = time.monotonic() - t0
        figures = {"redis_cmds_per_s": (sampler.commands() - c0) / dt,
                   "gateway_cpu": (sampler.cpu() - cpu0) / dt}
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return figures


def run(args: argparse.Namespace, wake: bool) -> dict[str, Any]:
    stack = start_stack(args, wake)
    try:
        sampler = Sampler(stack)
        sampler.start()
        pids = {"gateway": [stack.gateway.pid], "workers": [w.pid for w in stack.workers],
                "redis": [stack.server.proc.pid], "this client": [os.getpid()]}
        cpu0 = {k: sum(cpu_s(p) for p in v) for k, v in pids.items()}
        c0, t0 = sampler.commands(), time.monotonic()
        got = asyncio.run(load(stack, args))
        wall = time.monotonic() - t0
        cpu = {k: round(sum(cpu_s(p) for p in v) - cpu0[k], 1) for k, v in pids.items()}
        metrics = httpx.get(f"{stack.url}/metrics", timeout=10).text
        ttft_name = "tokenrelay_gateway_time_to_first_token_seconds"
        cmds = (sampler.commands() - c0) / wall
        r = redis.Redis(port=stack.server.port)
        steps = after_leaving(r, [j for s, j in got["left"] if s == 200])
        idle = asyncio.run(idle_phase(stack, args.idle, sampler)) if args.idle else {}
        sampler.stopping.set()
        statuses: dict[int, int] = {}
        for s, _ in [*got["left"], *got["held"], *got["ordinary"]]:
            statuses[s] = statuses.get(s, 0) + 1
        ttft = [t for s, (t, _) in got["held"] if s == 200]
        engine_ttft = worker_ttft(r, [j for s, (_, j) in got["held"] if s == 200])
        lat = [t for s, t in got["ordinary"] if s == 200]
        return {"reader_wake": wake, "wall_s": round(wall, 1), "statuses": statuses,
                "held_ttft_p50_ms": 1000 * percentile(ttft, 0.5),
                "held_ttft_p99_ms": 1000 * percentile(ttft, 0.99),
                "gateway_ttft_p50_le_ms": 1000 * histogram_quantile(metrics, ttft_name, 0.5),
                "gateway_ttft_p99_le_ms": 1000 * histogram_quantile(metrics, ttft_name, 0.99),
                "held_worker_ttft_p50_ms": 1000 * percentile(engine_ttft, 0.5),
                "held_worker_ttft_p99_ms": 1000 * percentile(engine_ttft, 0.99),
                "ordinary_p50_ms": 1000 * percentile(lat, 0.5),
                "ordinary_p99_ms": 1000 * percentile(lat, 0.99),
                "abandoned": len(steps),
                "steps_after_leaving_p50": percentile(steps, 0.5),
                "steps_after_leaving_p99": percentile(steps, 0.99),
                "steps_after_leaving_max": max(steps, default=-1),
                "not_cancelled": sum(1 for s in steps if s < 0),
                "gateway_peak_rss_mb": round(sampler.rss / 2**20, 1),
                "gateway_peak_redis_conns": sampler.conns,
                "redis_cmds_per_s": round(cmds), "cpu_s_during_load": cpu,
                "host_cores": psutil.cpu_count(), "load_avg_1m": os.getloadavg()[0],
                "idle": idle}
    finally:
        stack.stop()


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gateway_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=2000)
    p.add_argument("--abandon", type=float, default=0.5, help="fraction that leave early")
    p.add_argument("--held-tokens", type=int, default=200)
    p.add_argument("--ordinary", type=int, default=200)
    p.add_argument("--ordinary-rate", type=float, default=20.0, help="per second")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=1536)
    p.add_argument("--step-delay", type=float, default=0.02)
    p.add_argument("--idle", type=int, default=500, help="streams of the idle phase (0: none)")
    p.add_argument("--reader-wake", choices=["on", "off", "both"], default="on")
    p.add_argument("--resume-grace-s", type=float, default=0.0,
                   help="the gateway's; 0: an abandoned stream's job is cancelled at once")
    p.add_argument("--json", help="write the figures here too")
    args = p.parse_args(argv)
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.reader_wake]
    results = []
    for wake in modes:
        fig = run(args, wake)
        results.append(fig)
        print(json.dumps(fig, indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
