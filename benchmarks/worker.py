"""``python -m benchmarks.worker``: what does going through Redis cost?

Runs one workload in-process (this process steps the engine until done: ``LLMEngine``, or
``EngineCoreClient`` with ``--engine-process`` on, the worker's kind) and through Redis (a private
redis-server, one ``tokenrelay worker`` subprocess, all jobs submitted at once, a reader
following every result stream), alternating for ``--rounds``. Also prints the share of wall time
the worker spent inside ``engine.step()`` (from its metrics): on a shared, loaded machine the
two throughputs drift with the load, while 1 - share is the service's own overhead. Prints output tokens/s of both and their ratio (target >= 0.9),
and the p50/p99 delay from the engine emitting a token (``ts`` of the token event, taken when the
step returned) to the reader receiving it (target p99 < 5 ms on loopback).

Workload (the engine benchmark's): 48 requests, prompt length uniform 16-384 (random token ids),
output length uniform 16-192 with ``ignore_eos``, greedy, the ``bench``-size tiny checkpoint,
float32 on CPU (``--device cuda --dtype bfloat16`` beside a GPU: ``make gpu-check``'s keep_up
section runs it there, where the engine's step does not take the cores the worker, Redis and the
reader need). Not a test: it takes a minute or two.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import msgpack
import redis

from tokenrelay.protocol.keys import EVENT_FIELD, Keys
from tokenrelay.protocol.wire import JobRequest, encode_job

if TYPE_CHECKING:
    from benchmarks.delivery_floor import Floor

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


def make_workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  vocab: int, seed: int = 0) -> list[Request]:
    """The engine benchmark's workload (benchmarks/engine.py's generator), as requests."""
    from benchmarks.engine import make_workload as engine_workload
    return [Request(list(p), int(m))
            for p, m in engine_workload(n, prompt_range, output_range, vocab, seed)]


def ensure_model(path: Optional[str]) -> str:
    """The engine bench's checkpoint (.models/tiny-bench), written if missing."""
    if path:
        return path
    out = REPO / ".models" / "tiny-bench"
    if not (out / "config.json").exists():
        from tokenrelay.engine.tiny import write_checkpoint
        write_checkpoint(out, arch="llama", size="bench")
    return str(out)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine bench's settings, as EngineConfig keywords."""
    return dict(device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
                max_num_batched_tokens=args.max_num_batched_tokens,
                enforce_eager=args.enforce_eager)


def worker_flags(args: argparse.Namespace) -> list[str]:
    out = []
    for k, v in engine_kwargs(args).items():
        flag = k.replace("_", "-")
        out += ([f"--{flag}" if v else f"--no-{flag}"] if isinstance(v, bool)   # the CLI's bools
                else [f"--{flag}", str(v)])
    return out


def core_process(args: argparse.Namespace) -> bool:
    """``--engine-process`` resolved as the worker resolves it (auto: on for CUDA)."""
    from tokenrelay.worker.engine_api import core_process_on
    return core_process_on(args.engine_process, args.device)


def engine_kind(args: argparse.Namespace) -> str:
    """Which engine both sides run, for the printed figures."""
    return ("engine core in its own process (EngineCoreClient)" if core_process(args)
            else "engine core in the caller's process (LLMEngine)")


def params(req: Request) -> dict[str, Any]:
    return {"max_tokens": req.max_tokens, "temperature": 0, "ignore_eos": True}


# ------------------------------------------------------------------------------------------
# in-process
# ------------------------------------------------------------------------------------------

class InProcess:
    """The baseline: the engine stepped in a loop by this process, no Redis, built and warmed
    up once and reused across rounds (as the worker is: on a GPU each start costs a model
    load and graph capture). The same kind of engine the worker runs: an ``EngineCoreClient``
    when ``--engine-process`` resolves to on, so the ratio compares like with like."""

    def __init__(self, model: str, args: argparse.Namespace) -> None:
        from tokenrelay.engine.config import EngineConfig
        config = EngineConfig(model=model, **engine_kwargs(args))
        if core_process(args):
            self.engine: Any = _core_client(config, args.threads)
        else:
            from tokenrelay.engine.llm_engine import LLMEngine
            self.engine = LLMEngine(config)
        self.run([Request([11, 12, 13, 14], 4)] * 2)                    # warm-up

    def run(self, work: list[Request]) -> tuple[float, float]:
        """(output tok/s, output tokens per CPU-second of this process and its engine
        core's, when that has a process of its own)."""
        t0, c0 = time.perf_counter(), self.cpu_seconds()
        tokens = _drive(self.engine, work)
        return tokens / (time.perf_counter() - t0), tokens / (self.cpu_seconds() - c0)

    def cpu_seconds(self) -> float:
        core = getattr(self.engine, "proc", None)
        return time.process_time() + (cpu_seconds([core.pid]) if core is not None else 0.0)

    def close(self) -> None:
        self.engine.shutdown()


def _core_client(config: Any, threads: int) -> Any:
    """An EngineCoreClient whose core's process runs under the worker's OpenMP settings
    (worker/engine_api.openmp_defaults), as the worker's core does: with OpenMP's default
    long spin the core's threads kept both cores of a 2-core host busy between steps and
    starved this process, the front end (in-process 45-220 tok/s against 165-445 through
    Redis, 2026-12-05)."""
    from tokenrelay.engine.core_client import EngineCoreClient
    from tokenrelay.worker.engine_api import openmp_defaults
    added = {k: v for k, v in openmp_defaults().items() if k not in os.environ}
    os.environ.update(added)                    # the core's process inherits them
    try:
        return EngineCoreClient(config, threads=threads)
    finally:
        for name in added:
            del os.environ[name]


def _drive(eng: Any, work: list[Request]) -> int:
    from tokenrelay.engine.sampling_params import SamplingParams

    base = f"r{time.monotonic_ns()}-"
    for i, req in enumerate(work):
        eng.add_request(base + str(i), list(req.prompt_token_ids),
                        SamplingParams(**params(req)))
    tokens = 0
    while eng.has_unfinished_requests():
        tokens += sum(len(d.new_token_ids) for d in eng.step())
    return tokens


# ------------------------------------------------------------------------------------------
# through Redis
# ------------------------------------------------------------------------------------------

class Reader(threading.Thread):
    """Follows every result stream; records (receive - emit) per token.

    Each round pipelines a blocking XREAD with a non-blocking one over every open stream:
    Redis runs the second as soon as the first is answered, so all streams' new entries come
    back without a client round trip (entries already seen are skipped by id; before Redis 7.2
    a blocked multi-stream XREAD is answered with only the first stream that got data anyway).
    The blocking read waits on a few streams only, those that got entries in the last round
    (while there are any; else on every open one): a worker writes all of a step's streams in
    one script call, so any live stream wakes the reader as the step lands, and blocking on
    all 256 streams of a 5 ms step cost Redis ~0.7 ms a round, taken from the system under
    test on a small host. Both go out on a bare connection (hiredis-parsed replies, no
    client-side response callbacks): redis-py's per-command machinery costs ~0.2 ms, which
    would be measured as delivery delay."""

    BLOCK_ON = 8        # streams the blocking read waits on while some are live

    def __init__(self, url: str, keys: Keys, job_ids: list[str]) -> None:
        super().__init__(daemon=True)
        self.r = redis.Redis.from_url(url, socket_timeout=30)
        self.conn = self.r.connection_pool.make_connection()
        self.keys = keys
        self.last = {keys.results(j): "0-0" for j in job_ids}
        self.open = set(self.last)
        self.live: list[str] = []           # streams with entries in the last round
        self.delays: list[float] = []
        self.tokens = 0
        self.finished_at = 0.0
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            while self.open:
                keys = list(self.open)
                ids = [self.last[k] for k in keys]
                wait = [k for k in self.live if k in self.open][:self.BLOCK_ON] or keys
                self.live = []
                self.conn.send_packed_command(self.conn.pack_commands([
                    ("XREAD", "BLOCK", 1000, "STREAMS", *wait, *[self.last[k] for k in wait]),
                    ("XREAD", "STREAMS", *keys, *ids)]))
                first = self._take(self.conn.read_response(), time.time(), {})
                self._take(self.conn.read_response(), time.time(), first)
            self.finished_at = time.perf_counter()
        except BaseException as exc:  # reported by the main thread
            self.error = exc
        finally:
            self.conn.disconnect()

    def _take(self, reply: Any, now: float, seen: dict[str, int]) -> dict[str, int]:
        """Take a reply's entries; ``seen``: entries per stream the round's blocking read
        already took, which lead the non-blocking read's reply for that stream (both asked for
        entries after the same ids). Returns the entries taken per stream."""
        streams = reply.items() if isinstance(reply, dict) else reply or []  # RESP3 / RESP2
        taken: dict[str, int] = {}
        for stream, entries in streams:
            key = stream.decode()
            skip = seen.get(key, 0)
            if not entries or skip >= len(entries):
                continue
            taken[key] = len(entries)
            if not self.live or self.live[-1] != key:
                self.live.append(key)
            self.last[key] = entries[-1][0].decode()
            for _, flat in entries[skip:]:
                raw = flat[1] if flat[0] == EVENT_FIELD else dict(
                    zip(flat[0::2], flat[1::2]))[EVENT_FIELD]
                self._event(key, msgpack.unpackb(raw, strict_map_key=False), now)
        return taken

    def _event(self, key: str, ev: dict[str, Any], now: float) -> None:
        """One event as the SDK's readers take it: the raw msgpack map (protocol/fold.py), not
        a pydantic model (5-6 us an event: at 256 sequences a millisecond and a half of the
        shared host's CPU per step, spent by the benchmark rather than the system)."""
        kind = ev.get("type")
        if kind == "token":
            self.tokens += len(ev["token_ids"])
            self.delays.append(now - ev["ts"])
        elif kind in ("done", "error"):
            if kind == "error":
                raise RuntimeError(f"{key}: {ev.get('code')}: {ev.get('message')}")
            self.open.discard(key)


class WorkerProcess:
    """One ``tokenrelay worker`` on a private redis-server, reused across rounds; started
    here, ready once ``warm_up`` returned (meanwhile the caller may build its own engine:
    beside a GPU each load and graph capture takes many seconds)."""

    def __init__(self, model: str, args: argparse.Namespace) -> None:
        from devtools.redis_server import RedisServer, free_port
        self.srv = RedisServer(args=["--appendonly", "no"]).start()
        self.metrics_port = free_port()
        self._tmp = tempfile.TemporaryDirectory()
        self._log = open(Path(self._tmp.name) / "worker.log", "wb")
        env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenrelay.worker", "--model", model, "--redis-url", self.srv.url,
             "--worker-id", "bench", "--log-level", "warning", "--metrics-port",
             str(self.metrics_port), "--metrics-host", "127.0.0.1", *worker_flags(args),
             "--engine-process", "on" if core_process(args) else "off"],
            cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        self.r = redis.Redis.from_url(self.srv.url)
        self.rounds = 0

    def warm_up(self) -> None:
        """Wait for the model load: one tiny job through Redis."""
        self.run([Request([11, 12, 13, 14], 4)] * 2, timeout=600)

    def run(self, work: list[Request], timeout: float = 1800
            ) -> tuple[float, list[float], float, float]:
        """(output tok/s, delivery delays, share of the wall time the worker spent in steps,
        output tokens per CPU-second of the worker, its core and redis-server together)."""
        before, cpu0 = self.step_seconds(), self.cpu_seconds()
        self.rounds += 1
        # The reader thread shares this process with torch and the in-process run: keep full
        # collections of that heap out of its measurements, as the worker does for itself.
        from tokenrelay.heap import freeze_heap, thaw_heap
        freeze_heap()
        try:
            tps, delays, wall = _submit_and_read(self.r, self.srv.url, Keys(), f"r{self.rounds}",
                                                 work, timeout)
        finally:
            thaw_heap()     # frozen objects outlive exit: nanobind would list them as leaked
        cpu = self.cpu_seconds() - cpu0
        return tps, delays, (self.step_seconds() - before) / wall, tps * wall / cpu

    def cpu_seconds(self) -> float:
        """The worker's, its engine core's (when in a process of its own) and redis-server's."""
        import psutil
        pids = [self.proc.pid, self.srv.proc.pid]
        pids += [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        return cpu_seconds(pids)

    def step_seconds(self) -> float:
        import urllib.request
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                          timeout=5).read().decode()
        except OSError:
            return 0.0
        for line in body.splitlines():
            if line.startswith("tokenrelay_engine_step_seconds_sum"):
                return float(line.split()[-1])
        return 0.0

    def close(self) -> None:
        stop_process(self.proc, 60)
        self._log.close()
        self._tmp.cleanup()
        self.srv.stop()


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far."""
    import psutil
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM (a worker drains), SIGKILL after ``timeout`` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _submit_and_read(r: redis.Redis, url: str, keys: Keys, tag: str, work: list[Request],
                     timeout: float) -> tuple[float, list[float], float]:
    ids = [f"{tag}-{i}" for i in range(len(work))]
    reader = Reader(url, keys, ids)
    reader.start()
    pipe = r.pipeline(transaction=False)
    for jid, req in zip(ids, work):
        job = JobRequest(job_id=jid, prompt_token_ids=req.prompt_token_ids, params=params(req))
        pipe.xadd(keys.jobs_stream(0), {"data": encode_job(job)})
    t0 = time.perf_counter()
    pipe.execute()
    reader.join(timeout)
    if reader.error:
        raise reader.error
    if reader.is_alive():
        raise TimeoutError(f"{len(reader.open)} jobs unfinished after {timeout}s")
    wall = reader.finished_at - t0
    return reader.tokens / wall, reader.delays, wall


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000.0


def build_parser() -> argparse.ArgumentParser:
    """The workload and engine options (benchmarks.delivery_floor's writer takes them too)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.worker",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint (default: build the bench-size tiny one)")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--quick", action="store_true", help="16 requests, prompts 16-128, "
                   "outputs 16-64 (as benchmarks.engine --quick)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, or cuda beside a GPU")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--enforce-eager", action="store_true", help="no compiled kernels or CUDA "
                   "graphs: seconds less start-up, slower steps")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-kv-blocks", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--engine-process", choices=("auto", "on", "off"), default="auto",
                   help="the engine core in its own process, in the worker and the "
                   "in-process baseline alike (auto: on for CUDA, as the worker's default)")
    p.add_argument("--skip-in-process", action="store_true")
    p.add_argument("--rounds", type=int, default=1, help="alternate in-process and Redis runs")
    p.add_argument("--no-floor", action="store_true", help="skip the delivery floor "
                   "(benchmarks.delivery_floor: the engine alone, one XADD per step)")
    return p


def workload(args: argparse.Namespace) -> tuple[str, int, list[Request]]:
    """(checkpoint, its vocabulary size, requests) as the options ask."""
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    model = ensure_model(args.model)
    from tokenrelay.engine.model_config import ModelConfig
    vocab = ModelConfig.from_pretrained(model).vocab_size
    n, pr, orng = args.num_requests, (16, 384), (16, 192)
    if args.quick:
        n, pr, orng = min(n, 16), (16, 128), (16, 64)
    return model, vocab, make_workload(n, pr, orng, vocab, args.seed)


@dataclass
class Figures:
    """What ``measure`` found: per round (output tok/s, output tokens per CPU-second) in-process
    and through Redis, the worker's share of wall time inside ``engine.step``, every token
    event's delivery delay (seconds) and the delivery floor (None: not measured)."""

    in_process: list[tuple[float, float]] = field(default_factory=list)
    through_redis: list[tuple[float, float]] = field(default_factory=list)
    in_step: list[float] = field(default_factory=list)
    delays: list[float] = field(default_factory=list)
    floor: Optional["Floor"] = None
    engine: str = ""            # engine_kind(): which engine both sides ran

    def ratio(self, per_cpu: bool = False) -> Optional[float]:
        """Median over rounds of through-Redis / in-process (wall, or per CPU-second)."""
        if not self.in_process:
            return None
        k = 1 if per_cpu else 0
        return statistics.median(b[k] / a[k] for a, b in zip(self.in_process, self.through_redis))

    def summary(self) -> list[str]:
        med = statistics.median
        lines = [f"engine            : {self.engine}"] if self.engine else []
        if self.in_process:
            lines += [f"in-process engine : {med(a[0] for a in self.in_process):8.1f} output tok/s "
                      f"(median)",
                      f"through Redis     : {med(b[0] for b in self.through_redis):8.1f} output "
                      f"tok/s (median); ratio {self.ratio():.3f} wall-clock, "
                      f"{self.ratio(per_cpu=True):.3f} per CPU-second incl. redis-server "
                      f"(medians; target >= 0.9)"]
        d = self.delays
        lines.append(f"token delivery    : p50 {pct(d, 0.5):.2f} ms  p99 {pct(d, 0.99):.2f} ms  "
                     f"max {max(d) * 1000:.2f} ms over {len(d)} token events (target p99 < 5 ms)")
        if self.floor is not None:
            from benchmarks.delivery_floor import report
            lines += report(self.floor)
        return lines


def measure(argv: list[str], on_round: Callable[[str], None] = print) -> Figures:
    """Runs the benchmark ``argv`` asks for (this module's options); ``on_round`` gets one line
    per round as it ends."""
    args = build_parser().parse_args(argv)
    model, vocab, work = workload(args)
    on_round(f"workload: {len(work)} requests, {sum(len(w.prompt_token_ids) for w in work)} "
             f"prompt tokens, {sum(w.max_tokens for w in work)} output tokens; model {model} on "
             f"{args.device}, {args.dtype}")
    fig = Figures(engine=engine_kind(args))
    on_round(f"engine: {fig.engine}, in the worker and in-process alike")
    worker = WorkerProcess(model, args)
    local = None
    try:
        if not args.skip_in_process:
            local = InProcess(model, args)
        worker.warm_up()
        for rnd in range(args.rounds):  # alternate, so load drift on a shared box hits both
            # Fresh token ids each round (same lengths): both engines' prefix caches outlive a
            # round, and a repeat would skip the prefill.
            work_r = [Request([5 + (t - 5 + 7919 * rnd) % (vocab - 5) for t in w.prompt_token_ids],
                              w.max_tokens) for w in work]
            if local is not None:
                fig.in_process.append(local.run(work_r))
            tps, d, share, per_cpu = worker.run(work_r)
            fig.through_redis.append((tps, per_cpu))
            fig.in_step.append(share)
            fig.delays += d
            line = f"round {rnd + 1}: through Redis {tps:.1f} tok/s ({per_cpu:.1f} per CPU-s)"
            if fig.in_process:
                a, a_cpu = fig.in_process[-1]
                line += (f", in-process {a:.1f} tok/s ({a_cpu:.1f} per CPU-s): ratio "
                         f"{tps / a:.3f} wall, {per_cpu / a_cpu:.3f} per CPU-s")
            on_round(line + f"; worker inside engine.step {share:.1%} of the wall time")
    finally:
        if local is not None:
            local.close()
        worker.close()
    if not args.no_floor:
        from benchmarks.delivery_floor import measure_floor
        fig.floor = measure_floor(argv)
    return fig


def main(argv: Optional[list[str]] = None) -> int:
    fig = measure(sys.argv[1:] if argv is None else argv,
                  on_round=lambda line: print(line, flush=True))
    print("\n".join(fig.summary()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
