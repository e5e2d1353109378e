"""Serving benchmark: Poisson arrivals against an OpenAI-compatible endpoint, at several rates.

``python -m benchmarks.serving [--model .models/smollm2] [--rates 0.5,1,2,4]
[--requests 32] [--max-tokens 64] [--systems tokenrelay,sdk,transformers] [--plot-dir docs/bench]``

Systems, each started here on loopback ports and stopped afterwards:

- ``tokenrelay``: a private redis-server, ``tokenrelay worker --model M`` and the gateway
  ``tokenrelay gateway``; the load goes through HTTP (server-sent events);
- ``sdk``: the same worker through ``AsyncClient`` without HTTP: the gateway's own cost is the
  difference between the two;
- ``transformers``: ``transformers serve M --continuous-batching`` (transformers' own
  OpenAI-compatible server) on the same checkpoint, dtype and device.

Every request is a chat completion (greedy, ``max_tokens``), the prompts drawn in a fixed order
from a list of short English and Chinese questions, arrival gaps exponential with mean
1/rate (seeded, so every system sees the same schedule). Per request: time to first token
(TTFT), time per output token after the first (TPOT), inter-token latency (ITL, between
streamed chunks) and end-to-end latency; per rate: mean / p50 / p90 / p99 of each, output
tokens/s, and goodput (requests per second that met the SLO: TTFT <= --slo-ttft and TPOT <=
--slo-tpot). A table per system is printed; with matplotlib, plots of latency against rate go
to --plot-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import httpx

from devtools.redis_server import RedisServer, free_port

QUESTIONS = [
    "What is the capital of France?", "Name three primary colours.",
    "Why is the sky blue?", "Give me a tip for learning to cook.",
    "What does a compiler do?", "请用一句话介绍北京。",
    "Write a haiku about autumn.", "How do vaccines work?",
    "What is a prime number?", "Suggest a name for a cat.",
    "Explain what a queue is.", "中国的首都是哪里？",
    "What is the boiling point of water?", "How many legs does a spider have?",
    "Describe the moon in one sentence.", "What is machine learning?",
]


@dataclass
class Sample:
    """One request's timings (seconds, from its scheduled send time)."""

    ttft: Optional[float] = None
    e2e: Optional[float] = None
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: Optional[str] = None

    @property
    def tpot(self) -> Optional[float]:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


Sender = Callable[[list[dict], int], Awaitable[Sample]]


# --------------------------------------------------------------------------------------------
# load generators
# --------------------------------------------------------------------------------------------

def http_sender(base_url: str, model: str, client: httpx.AsyncClient) -> Sender:
    """Stream one chat completion over HTTP (SSE) and time its chunks."""
    async def send(messages: list[dict], max_tokens: int) -> Sample:
        body = {"model": model, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        s = Sample()
        start = time.perf_counter()
        try:
            async with client.stream("POST", f"{base_url}/v1/chat/completions",
                                     json=body) as resp:
                if resp.status_code != 200:
                    s.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                    return s
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    now = time.perf_counter() - start
                    if chunk.get("usage"):
                        s.output_tokens = chunk["usage"].get("completion_tokens", 0)
                    choices = chunk.get("choices") or []
                    if choices and (choices[0].get("delta") or {}).get("content"):
                        s.chunk_times.append(now)
                        if s.ttft is None:
                            s.ttft = now
        except httpx.HTTPError as exc:
            s.error = f"{type(exc).__name__}: {exc}"
            return s
        s.e2e = time.perf_counter() - start
        s.output_tokens = s.output_tokens or len(s.chunk_times)
        return s
    return send


def sdk_sender(client: Any) -> Sender:
    """The same request through the producer SDK's AsyncClient: no HTTP in between."""
    async def send(messages: list[dict], max_tokens: int) -> Sample:
        s = Sample()
        start = time.perf_counter()
        try:
            job = await client.submit(messages=messages, max_tokens=max_tokens, temperature=0.0)
            async for delta in job.stream(timeout=600):
                now = time.perf_counter() - start
                if delta.text:
                    s.chunk_times.append(now)
                    if s.ttft is None:
                        s.ttft = now
            result = await job.result(timeout=60)
            s.output_tokens = result.usage.completion_tokens
        except Exception as exc:          # a benchmark records failures, it does not stop
            s.error = f"{type(exc).__name__}: {exc}"
            return s
        s.e2e = time.perf_counter() - start
        return s
    return send


async def run_rate(send: Sender, rate: float, requests: int, max_tokens: int,
                   seed: int) -> tuple[list[Sample], float]:
    """Send ``requests`` at Poisson arrivals of ``rate``/s; (samples, wall seconds)."""
    rng = random.Random(seed)
    gaps = [rng.expovariate(rate) for _ in range(requests)]
    start = time.perf_counter()
    tasks = []
    at = 0.0
    for i, gap in enumerate(gaps):
        at += gap
        delay = at - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        tasks.append(asyncio.create_task(send(messages, max_tokens)))
    samples = list(await asyncio.gather(*tasks))
    return samples, time.perf_counter() - start


# --------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------

def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


def summarize(samples: list[Sample], wall: float, slo_ttft: float,
              slo_tpot: float) -> dict[str, Any]:
    ok = [s for s in samples if s.error is None and s.e2e is not None]
    out: dict[str, Any] = {"requests": len(samples), "errors": len(samples) - len(ok)}
    series = {"ttft": [s.ttft for s in ok if s.ttft is not None],
              "tpot": [s.tpot for s in ok if s.tpot is not None],
              "itl": [x for s in ok for x in s.itls],
              "e2e": [s.e2e for s in ok]}
    for name, values in series.items():
        out[name] = {"mean": statistics.fmean(values) if values else float("nan"),
                     "p50": pct(values, 50), "p90": pct(values, 90), "p99": pct(values, 99)}
    out["output_tok_s"] = sum(s.output_tokens for s in ok) / wall
    good = [s for s in ok if s.ttft is not None and s.ttft <= slo_ttft
            and (s.tpot is None or s.tpot <= slo_tpot)]
    out["goodput_req_s"] = len(good) / wall
    out["slo_met"] = len(good) == len(samples)
    errors = [s.error for s in samples if s.error]
    if errors:
        out["first_error"] = errors[0]
    return out


def print_table(system: str, rows: dict[float, dict[str, Any]]) -> None:
    print(f"\n== {system}")
    print(f"{'rate':>6} {'ttft p50':>9} {'ttft p99':>9} {'tpot p50':>9} {'tpot p99':>9} "
          f"{'itl p50':>8} {'e2e p50':>8} {'e2e p99':>8} {'tok/s':>7} {'goodput':>8} {'err':>4}")
    for rate, r in rows.items():
        ms = lambda k, q: r[k][q] * 1000  # noqa: E731
        print(f"{rate:6.2f} {ms('ttft', 'p50'):9.1f} {ms('ttft', 'p99'):9.1f} "
              f"{ms('tpot', 'p50'):9.1f} {ms('tpot', 'p99'):9.1f} {ms('itl', 'p50'):8.1f} "
              f"{r['e2e']['p50']:8.2f} {r['e2e']['p99']:8.2f} {r['output_tok_s']:7.1f} "
              f"{r['goodput_req_s']:8.2f} {r['errors']:4d}")
        if "first_error" in r:
            print(f"       first error: {r['first_error']}")


LABELS = {"tokenrelay": "tokenrelay gateway (HTTP)", "sdk": "tokenrelay SDK (no HTTP)",
          "transformers": "transformers serve --continuous-batching"}


def plot(results: dict[str, dict[float, dict[str, Any]]], out_dir: Path, note: str) -> list[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install 'tokenrelay[bench]')")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for metric, label in (("ttft", "time to first token"), ("tpot", "time per output token"),
                          ("e2e", "end-to-end latency")):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, q in zip(axes, ("p50", "p99")):
            for system, rows in results.items():
                rates = list(rows)
                ax.plot(rates, [rows[r][metric][q] * 1000 for r in rates], marker="o",
                        label=LABELS.get(system, system))
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(f"{q} {label} (ms)")
            ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            ax.legend()
        fig.suptitle(f"{label} vs load\n{note}", fontsize=9)
        fig.tight_layout()
        path = out_dir / f"serving_{metric}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# --------------------------------------------------------------------------------------------
# the systems under test
# --------------------------------------------------------------------------------------------

class Stack:
    """Processes started for one system; stopped (process groups) however the run ends."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.redis: Optional[RedisServer] = None
        self.logs: list[Any] = []

    def spawn(self, cmd: list[str], name: str, env: Optional[dict] = None) -> subprocess.Popen:
        log = open(f"/tmp/bench_serving_{name}.log", "w")
        self.logs.append(log)
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, **(env or {})})
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(timeout=20)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        if self.redis is not None:
            self.redis.stop()
        for log in self.logs:
            log.close()


def wait_http(url: str, proc: subprocess.Popen, timeout: float, name: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}: see "
                               f"/tmp/bench_serving_{name}.log")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name} did not answer {url} within {timeout}s")


def start_tokenrelay(stack: Stack, model: str, args: argparse.Namespace,
                     with_gateway: bool) -> dict[str, str]:
    stack.redis = RedisServer().start()
    url = stack.redis.url
    worker = stack.spawn([sys.executable, "-m", "tokenrelay.worker", "--model", model, "--redis-url", url,
                          "--dtype", "float32", "--worker-id", "bench-serving"], "worker")
    deadline = time.monotonic() + 300
    import redis as redis_lib
    r = redis_lib.Redis.from_url(url)
    while not r.zcard("tokenrelay:workers:default"):
        if worker.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the worker did not start: see /tmp/bench_serving_worker.log")
        time.sleep(0.5)
    out = {"redis_url": url}
    if with_gateway:
        port = free_port()
        gw = stack.spawn([sys.executable, "-m", "tokenrelay.producer_sdk.gateway", "--redis-url", url,
                          "--host", "127.0.0.1", "--port", str(port)], "gateway")
        wait_http(f"http://127.0.0.1:{port}/health", gw, 60, "gateway")
        out["base_url"] = f"http://127.0.0.1:{port}"
    return out


def start_transformers(stack: Stack, model: str) -> str:
    port = free_port()
    exe = Path(sys.executable).with_name("transformers")
    proc = stack.spawn([str(exe), "serve", model, "--continuous-batching", "--device", "cpu",
                        "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)],
                       "transformers")
    wait_http(f"http://127.0.0.1:{port}/health", proc, 300, "transformers")
    return f"http://127.0.0.1:{port}"


async def sweep(send: Sender, args: argparse.Namespace) -> dict[float, dict[str, Any]]:
    rows: dict[float, dict[str, Any]] = {}
    await run_rate(send, 8.0, 4, 8, seed=999)               # warm-up: compile, caches
    for rate in args.rates:
        samples, wall = await run_rate(send, rate, args.requests, args.max_tokens, args.seed)
        rows[rate] = summarize(samples, wall, args.slo_ttft, args.slo_tpot)
    return rows


async def bench_system(system: str, args: argparse.Namespace) -> dict[float, dict[str, Any]]:
    stack = Stack()
    try:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
        if system == "transformers":
            base = start_transformers(stack, args.model)
            model = args.model
        elif system in ("tokenrelay", "sdk"):
            info = start_tokenrelay(stack, args.model, args, with_gateway=system == "tokenrelay")
            model = Path(args.model.rstrip("/")).name
            if system == "sdk":
                from tokenrelay.producer_sdk import AsyncClient
                async with AsyncClient(redis_url=info["redis_url"]) as client:
                    return await sweep(sdk_sender(client), args)
            base = info["base_url"]
        else:
            raise SystemExit(f"unknown system {system!r}")
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            return await sweep(http_sender(base, model, client), args)
    finally:
        stack.close()


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serving",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=".models/smollm2",
                    help="checkpoint folder (tokenrelay fetch smollm2 .models/smollm2)")
    ap.add_argument("--rates", default="0.5,1,2,4",
                    type=lambda s: [float(x) for x in s.split(",")])
    ap.add_argument("--requests", type=int, default=32, help="requests per rate")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--systems", default="tokenrelay,sdk,transformers")
    ap.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    ap.add_argument("--slo-tpot", type=float, default=0.15, help="seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot-dir", default="docs/bench")
    ap.add_argument("--json", help="also write every figure to this JSON file")
    ap.add_argument("--replot", help="only redraw the plots from a --json file of an earlier run")
    args = ap.parse_args(argv)
    note = (f"{Path(args.model).name}, CPU float32, {args.requests} req/rate, "
            f"max_tokens {args.max_tokens}; python -m benchmarks.serving")
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        for path in plot({s: {float(k): v for k, v in rows.items()} for s, rows in saved.items()},
                         Path(args.plot_dir), note):
            print(f"plot: {path}")
        return
    if not Path(args.model, "config.json").is_file():
        raise SystemExit(f"{args.model}: no checkpoint (tokenrelay fetch smollm2 "
                         f"{args.model})")
    print(f"model {args.model}, {args.requests} requests per rate, max_tokens "
          f"{args.max_tokens}, greedy; SLO: TTFT <= {args.slo_ttft * 1000:.0f} ms and TPOT <= "
          f"{args.slo_tpot * 1000:.0f} ms")
    results: dict[str, dict[float, dict[str, Any]]] = {}
    for system in args.systems.split(","):
        t0 = time.perf_counter()
        results[system] = asyncio.run(bench_system(system, args))
        print_table(system, results[system])
        print(f"   ({time.perf_counter() - t0:.0f} s)")
    for system, rows in results.items():
        best = max((r for r, row in rows.items() if row["slo_met"]), default=None)
        print(f"highest rate meeting the SLO, {system}: {best if best is not None else 'none'}")
    for path in plot(results, Path(args.plot_dir), note):
        print(f"plot: {path}")
    if args.json:
        Path(args.json).write_text(json.dumps({s: {str(k): v for k, v in rows.items()}
                                               for s, rows in results.items()}, indent=1))


if __name__ == "__main__":
    main()
