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

The real engine runs the same way with a simulated device (``--simulated-device-ms``: its
scheduler, sampler and output processing, around a forward pass that sleeps the step time,
engine/simulated.py): ``engine`` keeps the overlapped engine core in the worker's process,
``engine-process`` runs it in a process of its own (``--engine-process on``: the worker's
process keeps the output processing, the events and Redis). Their "alone" baseline is the same
engine stepping in this process without Redis.

Prints token events/s of each and the ratio to its engine alone (target >= 0.95 at 10 ms x
128 and 5 ms x 256), and where the time goes, per engine step (tokens / sequences): the
worker's CPU (user + system, psutil; its engine core's process apart) and, of it, the events,
flush and accounting (the worker's ``tokenrelay_step_events_cpu_seconds``); the
redis-server's (``INFO cpu``); the reader's (this process's, which does nothing else
meanwhile; it decodes events as the SDK does, raw msgpack maps); flush round trips and Redis
commands (the worker's metrics and ``INFO stats``); and token delivery p50/p99 (from the
step's end to the reader).
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
from typing import Any, Optional

import redis

from benchmarks.worker import Request, _submit_and_read, pct, stop_process
from tokenrelay.protocol.keys import Keys

REPO = Path(__file__).resolve().parent.parent
FAKE_MODES = ("overlapped", "serial")
ENGINE_MODES = ("engine", "engine-process")
MODES = FAKE_MODES + ENGINE_MODES
DEFAULT_MODES = ("overlapped", "engine", "engine-process")


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
    events_cpu: float       # of worker_cpu: events, flush and accounting (the writer's thread)
    core_cpu: float
    redis_cpu: float
    reader_cpu: float
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


def engine_alone(s: Setting, work: list[Request], kind: str, checkpoint: Path) -> float:
    """Token events/s of the engine stepping alone, in this process: the fake one (``fake``),
    or the real one around the simulated device, its core here (``engine``) or in a process
    of its own (``engine-process``)."""
    from tokenrelay.engine.sampling_params import SamplingParams
    eng = make_engine(s, kind, checkpoint)
    try:
        for i, req in enumerate(work):
            eng.add_request(f"a{i}", list(req.prompt_token_ids),
                            SamplingParams(max_tokens=req.max_tokens, temperature=0,
                                           ignore_eos=True))
        t0, events = time.perf_counter(), 0
        while eng.has_unfinished_requests():
            events += sum(len(d.new_token_ids) for d in eng.step())
        return events / (time.perf_counter() - t0)
    finally:
        getattr(eng, "shutdown", lambda: None)()


def engine_flags(s: Setting, checkpoint: Path) -> dict[str, str]:
    """The real engine's settings around the simulated device (worker flags, and the
    EngineConfig fields of the same names)."""
    # max_model_len just fits a job (12 prompt tokens + its output): the scheduler's
    # capacity counts a typical request as min(max_model_len, 512) tokens of KV.
    per_job = -(-(12 + s.tokens + 2) // 16)
    blocks = s.seqs * per_job + 8
    return {"simulated-device-ms": str(s.step_ms), "max-num-seqs": str(s.seqs),
            "num-kv-blocks": str(blocks), "max-model-len": str(16 * per_job),
            "dtype": "float32",
            "max-num-batched-tokens": str(max(2048, 16 * s.seqs))}


def make_engine(s: Setting, kind: str, checkpoint: Path) -> Any:
    if kind == "fake":
        from tokenrelay.worker.fake_engine import FakeEngine
        return FakeEngine(max_num_seqs=s.seqs, step_delay=s.step_ms / 1000.0)
    from tokenrelay.engine.config import EngineConfig
    kw = {k.replace("-", "_"): v for k, v in engine_flags(s, checkpoint).items()}
    config = EngineConfig(
        model=str(checkpoint), device="cpu", dtype="float32",
        simulated_device_ms=float(kw["simulated_device_ms"]), max_num_seqs=s.seqs,
        num_kv_blocks=int(kw["num_kv_blocks"]), max_model_len=int(kw["max_model_len"]),
        max_num_batched_tokens=int(kw["max_num_batched_tokens"]), async_scheduling=True)
    if kind == "engine-process":
        from tokenrelay.engine.core_client import EngineCoreClient
        return EngineCoreClient(config, threads=1)
    from tokenrelay.engine.llm_engine import LLMEngine
    return LLMEngine(config)


def kind_of(mode: str) -> str:
    return "fake" if mode in FAKE_MODES else mode


class WorkerUnderTest:
    """A private redis-server and one ``tokenrelay worker --model fake:...`` on it."""

    def __init__(self, s: Setting, mode: str, checkpoint: Path) -> None:
        from devtools.redis_server import RedisServer, free_port
        self.s = s
        self.srv = RedisServer(args=["--appendonly", "no"]).start()
        self.metrics_port = free_port()
        self._tmp = tempfile.TemporaryDirectory()
        self._log = open(Path(self._tmp.name) / "worker.log", "wb")
        if mode in FAKE_MODES:
            model = f"fake:step_delay={s.step_ms / 1000.0},max_num_seqs={s.seqs}"
            flags = ["--no-overlap-steps"] if mode == "serial" else []
        else:
            model = str(checkpoint)
            flags = [f"--{k}={v}" for k, v in engine_flags(s, checkpoint).items()]
            flags += ["--engine-process", "on" if mode == "engine-process" else "off",
                      "--async-scheduling", "--overlap-steps"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenrelay.worker", "--model", model, "--redis-url", self.srv.url,
             "--worker-id", f"sim-{mode}", "--log-level", "warning", "--metrics-port",
             str(self.metrics_port), "--metrics-host", "127.0.0.1", *flags],
            cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("TOKENRELAY_")})
        self.r = redis.Redis.from_url(self.srv.url)
        self.rounds = 0
        try:
            self.run([Request([97, 98, 99], 4)] * 2, timeout=300)    # start-up and warm-up
        except BaseException:
            self.close()        # a worker that never came up must not outlive the benchmark
            raise

    def run(self, work: list[Request], timeout: float = 600) -> Run:
        m0, i0, c0, k0 = self.metrics(), self.info(), self.cpu(False), self.cpu(True)
        self.rounds += 1
        r0 = time.process_time()        # this process does nothing but read meanwhile
        events, delays, wall = _submit_and_read(self.r, self.srv.url, Keys(),
                                                f"r{self.rounds}", work, timeout=timeout)
        reader = time.process_time() - r0
        m1, i1, c1, k1 = self.metrics(), self.info(), self.cpu(False), self.cpu(True)
        # Engine steps: every sequence gets one token a step (a core in its own process
        # hands the worker several steps at a time, so its step count is not the engine's).
        steps = max(1.0, events * wall / max(1, len(work)))
        # max(0, ...): a delta of two sums of rounded clock ticks can come out as -1e-17
        return Run(events, wall, steps, max(0.0, c1 - c0) / steps,
                   (m1["events_cpu"] - m0["events_cpu"]) / steps, max(0.0, k1 - k0) / steps,
                   max(0.0, i1["cpu"] - i0["cpu"]) / steps, reader / steps,
                   (m1["flushes"] - m0["flushes"]) / steps,
                   (i1["commands"] - i0["commands"]) / steps, delays)

    def cpu(self, core: bool) -> float:
        """CPU seconds of the worker's process, or of its engine core's process (0 when the
        core runs in the worker)."""
        import psutil
        proc = psutil.Process(self.proc.pid)
        procs = proc.children() if core else [proc]
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += t.user + t.system
        return total

    def metrics(self) -> dict[str, float]:
        names = {"tokenrelay_engine_step_seconds_count": "steps",
                 "tokenrelay_step_redis_seconds_count": "flushes",
                 "tokenrelay_step_events_cpu_seconds_total": "events_cpu"}
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


def measure(s: Setting, rounds: int, modes: tuple[str, ...], checkpoint: Path
            ) -> tuple[dict[str, list[float]], dict[str, list[Run]]]:
    """Alternate each engine alone and each mode through Redis for ``rounds``."""
    kinds = sorted({kind_of(m) for m in modes})
    alone: dict[str, list[float]] = {k: [] for k in kinds}
    runs: dict[str, list[Run]] = {m: [] for m in modes}
    workers: dict[str, WorkerUnderTest] = {}
    try:
        for m in modes:
            workers[m] = WorkerUnderTest(s, m, checkpoint)
        for rnd in range(rounds):
            work = workload(s, rnd)
            for k in kinds:
                alone[k].append(engine_alone(s, work, k, checkpoint))
            for m in modes:
                runs[m].append(workers[m].run(work))
    finally:
        for w in workers.values():
            w.close()
    return alone, runs


def report(s: Setting, alone: dict[str, list[float]], runs: dict[str, list[Run]]
           ) -> list[str]:
    med = statistics.median
    lines = [f"{s.label} ({s.tokens} tokens each): alone " + ", ".join(
        f"{k} {med(v):.0f}" for k, v in alone.items()) + f" token events/s (medians of "
        f"{len(next(iter(alone.values())))})"]
    for mode, rs in runs.items():
        base = alone[kind_of(mode)]
        ratio = med([r.events_per_s / a for r, a in zip(rs, base)])
        delays = [d for r in rs for d in r.delays]
        core = med([r.core_cpu for r in rs])
        core_text = f" (+ its core's process {core * 1e3:.2f} ms)" if core else ""
        per_seq = med([r.worker_cpu for r in rs]) * 1e6 / s.seqs
        lines.append(
            f"  {mode:14s} through Redis {med([r.events_per_s for r in rs]):9.0f} events/s, "
            f"ratio {ratio:.3f}; per step: worker CPU {med([r.worker_cpu for r in rs]) * 1e3:.2f}"
            f" ms ({per_seq:.1f} us/seq; of which events and flush "
            f"{med([r.events_cpu for r in rs]) * 1e3:.2f} ms, "
            f"{med([r.events_cpu for r in rs]) * 1e6 / s.seqs:.1f} us/seq){core_text}, redis CPU "
            f"{med([r.redis_cpu for r in rs]) * 1e3:.2f} ms, reader CPU "
            f"{med([r.reader_cpu for r in rs]) * 1e3:.2f} ms, "
            f"{med([r.flushes for r in rs]):.2f} flush round trips, "
            f"{med([r.commands for r in rs]):.1f} redis commands; delivery p50 "
            f"{pct(delays, 0.5):.2f} ms p99 {pct(delays, 0.99):.2f} ms")
    return lines


def checkpoint_dir(path: Optional[str]) -> Path:
    """A tiny checkpoint: the real engine's tokenizer and config (its device is simulated)."""
    from tokenrelay.engine.tiny import write_checkpoint
    out = Path(path) if path else Path(tempfile.mkdtemp(prefix="simulated-gpu-"))
    if not (out / "config.json").exists():
        write_checkpoint(out, arch="llama", size="tiny")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.simulated_gpu",
                                description=__doc__.split("\n")[0])
    p.add_argument("--setting", action="append", metavar="MSxSEQS",
                   help="step ms x sequences, repeatable (default: 10x128 and 5x256)")
    p.add_argument("--tokens", type=int, default=200, help="tokens per sequence")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mode", choices=MODES, action="append",
                   help=f"worker modes to run (default: {', '.join(DEFAULT_MODES)})")
    p.add_argument("--checkpoint", help="folder for the tiny checkpoint (written when missing)")
    args = p.parse_args(argv)
    settings = [parse_setting(t, args.tokens) for t in (args.setting or ["10x128", "5x256"])]
    modes = tuple(args.mode or DEFAULT_MODES)
    checkpoint = checkpoint_dir(args.checkpoint)
    for s in settings:
        alone, runs = measure(s, args.rounds, modes, checkpoint)
        print("\n".join(report(s, alone, runs)), flush=True)
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
