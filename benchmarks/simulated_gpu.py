"""``python -m benchmarks.simulated_gpu``: can one worker keep up with a GPU?

A GPU decode step of a small or medium model takes 5-15 ms for 64-256 sequences, and most of
it is a sync that releases the GIL. The fake engine stands in for it with a fixed step time
(``fake:step_delay``, a ``time.sleep``), one token per running sequence per step. For each
setting (10 ms x 128 streamed sequences and 5 ms x 256, 200 tokens each by default) this
runs the engine stepping alone in-process, then the same work through one private redis-server
and one ``tokenrelay worker`` subprocess (all jobs submitted at once, a reader following every
result stream), with the worker's writer overlapping the flush with the next step
(``overlapped``) and, for comparison, flushing in series (``--no-overlap-steps``: the loop as
it was before). Rounds alternate the three, so load drift on a shared host hits all of them.

Prints token events/s of each and the ratio to the engine alone (target >= 0.95 at 10 ms x
128), and where the time goes: the worker's CPU seconds (user + system, psutil) and the
redis-server's (``INFO cpu``) per engine step, flush round trips and Redis commands per step
(the worker's metrics and ``INFO stats``), and token delivery p50/p99 (from the step's end to
the reader).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import redis

from benchmarks.worker import Request, _submit_and_read, pct, stop_process
from tokenrelay.protocol.keys import Keys

REPO = Path(__file__).resolve().parent.parent
MODES = ("overlapped", "serial")


@dataclass(frozen=True)
class Setting:
    step_ms: float
    seqs: int
    tokens: int

    @property
    def label(self) -> str:
        return f"{self.step_ms:g} ms x {self.seqs}"


@dataclass
class Run:
    """One run through Redis."""

    events_per_s: float
    wall: float
    steps: float
    worker_cpu: float
    redis_cpu: float
    flushes: float
    commands: float
    delays: list[float]


def parse_setting(text: str, tokens: int) -> Setting:
    """``10x128`` -> 10 ms steps, 128 sequences."""
    ms, _, seqs = text.lower().partition("x")
    return Setting(float(ms), int(seqs), tokens)


def workload(s: Setting, round_no: int) -> list[Request]:
    """Distinct prompts (token ids, so no tokenizer) per round; every job runs ``tokens``."""
    return [Request([97 + (i * 7 + round_no * 13 + k) % 26 for k in range(12)], s.tokens)
            for i in range(s.seqs)]


def engine_alone(s: Setting, work: list[Request]) -> float:
    """Token events/s of the fake engine stepping alone, in this process."""
    from tokenrelay.engine.sampling_params import SamplingParams
    from tokenrelay.worker.fake_engine import FakeEngine
    eng = FakeEngine(max_num_seqs=s.seqs, step_delay=s.step_ms / 1000.0)
    for i, req in enumerate(work):
        eng.add_request(f"a{i}", list(req.prompt_token_ids),
                        SamplingParams(max_tokens=req.max_tokens, temperature=0))
    t0, events = time.perf_counter(), 0
    while eng.has_unfinished_requests():
        events += len(eng.step())
    return events / (time.perf_counter() - t0)


class WorkerUnderTest:
    """A private redis-server and one ``tokenrelay worker --model fake:...`` on it."""

    def __init__(self, s: Setting, mode: str) -> None:
        from devtools.redis_server import RedisServer, free_port
        self.srv = RedisServer(args=["--appendonly", "no"]).start()
        self.metrics_port = free_port()
        self._tmp = tempfile.TemporaryDirectory()
        self._log = open(Path(self._tmp.name) / "worker.log", "wb")
        model = f"fake:step_delay={s.step_ms / 1000.0},max_num_seqs={s.seqs}"
        flags = ["--no-overlap-steps"] if mode == "serial" else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenrelay.worker", "--model", model, "--redis-url", self.srv.url,
             "--worker-id", f"sim-{mode}", "--log-level", "warning", "--metrics-port",
             str(self.metrics_port), "--metrics-host", "127.0.0.1", *flags],
            cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("TOKENRELAY_")})
        self.r = redis.Redis.from_url(self.srv.url)
        self.rounds = 0
        self.run([Request([97, 98, 99], 4)] * 2)     # start-up and warm-up

    def run(self, work: list[Request]) -> Run:
        import psutil
        proc = psutil.Process(self.proc.pid)
        m0, i0, c0 = self.metrics(), self.info(), proc.cpu_times()
        self.rounds += 1
        events, delays, wall = _submit_and_read(self.r, self.srv.url, Keys(),
                                                f"r{self.rounds}", work, timeout=600)
        m1, i1, c1 = self.metrics(), self.info(), proc.cpu_times()
        steps = max(1.0, m1["steps"] - m0["steps"])
        # max(0, ...): a delta of two sums of rounded clock ticks can come out as -1e-17
        return Run(events, wall, steps, max(0.0, (c1.user + c1.system) - (c0.user + c0.system))
                   / steps, max(0.0, i1["cpu"] - i0["cpu"]) / steps, (m1["flushes"] - m0["flushes"]) / steps,
                   (i1["commands"] - i0["commands"]) / steps, delays)

    def metrics(self) -> dict[str, float]:
        names = {"tokenrelay_engine_step_seconds_count": "steps",
                 "tokenrelay_step_redis_seconds_count": "flushes"}
        out = {v: 0.0 for v in names.values()}
        deadline = time.monotonic() + 30
        while True:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                              timeout=5).read().decode()
                break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.2)
        for line in body.splitlines():
            name = line.split("{")[0].split(" ")[0]
            if name in names:
                out[names[name]] = float(line.split()[-1])
        return out

    def info(self) -> dict[str, float]:
        cpu, stats = self.r.info("cpu"), self.r.info("stats")
        return {"cpu": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
                "commands": float(stats["total_commands_processed"])}

    def close(self) -> None:
        stop_process(self.proc, 30)
        self._log.close()
        self._tmp.cleanup()
        self.r.close()
        self.srv.stop()


def measure(s: Setting, rounds: int, modes: tuple[str, ...] = MODES
            ) -> tuple[list[float], dict[str, list[Run]]]:
    """Alternate the engine alone and each mode through Redis for ``rounds``."""
    alone: list[float] = []
    runs: dict[str, list[Run]] = {m: [] for m in modes}
    workers = {m: WorkerUnderTest(s, m) for m in modes}
    try:
        for rnd in range(rounds):
            work = workload(s, rnd)
            alone.append(engine_alone(s, work))
            for m in modes:
                runs[m].append(workers[m].run(work))
    finally:
        for w in workers.values():
            w.close()
    return alone, runs


def report(s: Setting, alone: list[float], runs: dict[str, list[Run]]) -> list[str]:
    med = statistics.median
    lines = [f"{s.label} ({s.tokens} tokens each): engine alone {med(alone):9.0f} token "
             f"events/s (median of {len(alone)})"]
    for mode, rs in runs.items():
        ratio = med([r.events_per_s / a for r, a in zip(rs, alone)])
        delays = [d for r in rs for d in r.delays]
        lines.append(
            f"  {mode:10s} through Redis {med([r.events_per_s for r in rs]):9.0f} events/s, "
            f"ratio {ratio:.3f}; per step: worker CPU {med([r.worker_cpu for r in rs]) * 1e3:.2f}"
            f" ms, redis CPU {med([r.redis_cpu for r in rs]) * 1e3:.2f} ms, "
            f"{med([r.flushes for r in rs]):.2f} flush round trips, "
            f"{med([r.commands for r in rs]):.1f} redis commands; delivery p50 "
            f"{pct(delays, 0.5):.2f} ms p99 {pct(delays, 0.99):.2f} ms")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.simulated_gpu",
                                description=__doc__.split("\n")[0])
    p.add_argument("--setting", action="append", metavar="MSxSEQS",
                   help="step ms x sequences, repeatable (default: 10x128 and 5x256)")
    p.add_argument("--tokens", type=int, default=200, help="tokens per sequence")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mode", choices=MODES, action="append",
                   help="worker modes to run (default: both)")
    args = p.parse_args(argv)
    settings = [parse_setting(t, args.tokens) for t in (args.setting or ["10x128", "5x256"])]
    modes = tuple(args.mode or MODES)
    for s in settings:
        alone, runs = measure(s, args.rounds, modes)
        print("\n".join(report(s, alone, runs)), flush=True)
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
