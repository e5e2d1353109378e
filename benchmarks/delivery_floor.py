"""``python -m benchmarks.delivery_floor``: the least token delivery delay this host allows.

``benchmarks.worker`` measures token delivery from the end of an engine step (the token
event's ``ts``) to a reader in another process. Part of that delay is not the worker's: an
event that leaves one process, wakes redis-server and then the reader pays for each wake-up
(on a virtual machine a vCPU that sat idle through a step takes hundreds of microseconds to
wake), and the reader must get a core while the engine's next step computes on all of them.
This measures that floor with nothing of the worker on the path: a writer process runs the
worker benchmark's workload on the engine alone (``LLMEngine``, same options) and after each
step XADDs ONE token event (``ts`` taken when the step returned) to ONE result stream; the
reader is the worker benchmark's own (``benchmarks.worker.Reader``, a thread in this process,
blocked on XREAD), on a private redis-server; percentiles over tokens, as the worker
benchmark's. Its p50 is a floor: the worker's p50 minus it is what the worker, its step script
(every running job's events, fenced) and the reader's XREAD of every stream add. Its tail is
not a bound on the worker's: on a host whose cores the engine's step fills (the CPU engine),
a reader that was not scheduled before the next step began waits for a core, and the worker,
whose flush round trip keeps it off the cores for about a millisecond after the step, leaves
the reader more room than this writer, whose one XADD returns in a fraction of that. (On the
2-core development host this writer sleeping 0.5 ms after each XADD brought the floor's p99
from 3.4-4.8 ms to 0.8-0.9 ms, while the same sleep after the worker's flush left the worker's
p99 where it was: the worker's tail is in its flush.)

It also measures what the host's wake-ups cost alone (``wake_probe``): after the writer is
done, one PING to the same redis-server after each of ``WAKE_PINGS`` silences as long as the
engine's median step, from this process: two wake-ups (redis-server, then the caller), both
after sleeping through a step, as a delivered token's (redis-server, then the reader), with no
engine, worker or script on the path. On the 2-core development VM (2026-12-03) that round
trip is 0.03 ms after 1 ms of silence but 0.9-1.0 ms at p50 and 2.1-2.6 ms at p99 after 70 ms
(the bench-size engine's step): a vCPU that idled through a step wakes slowly, whatever runs.

    python -m benchmarks.delivery_floor [the options of benchmarks.worker]

``benchmarks.worker`` prints it after its own figures (``--no-floor`` skips it). Not a test:
it prints measured figures.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import redis

from tokenrelay.protocol.events import DoneEvent, encode_event
from tokenrelay.protocol.keys import EVENT_FIELD, Keys

REPO = Path(__file__).resolve().parent.parent
JOB_ID = "floor"
WAKE_PINGS = 60          # round trips of the wake probe (60 x a 70 ms step: 4 s)
WAKE_GAP_S = (0.001, 0.2)  # the probe's silence: the engine's median step, within these bounds


@dataclass
class Floor:
    """What ``measure_floor`` found: one delivery delay per token the engine made (seconds),
    the engine's median step (the interval between the writer's events) and the wake probe's
    round trips after a silence that long."""

    delays: list[float]
    step_s: float
    wakes: list[float]


def write(url: str, argv: list[str]) -> None:
    """The writer process: the workload on the engine alone, one token event per step."""
    from benchmarks.worker import build_parser, engine_kwargs, params, workload
    from tokenrelay.engine.config import EngineConfig
    from tokenrelay.engine.llm_engine import LLMEngine
    from tokenrelay.engine.sampling_params import SamplingParams
    from tokenrelay.worker.jobs import encode_token_event
    args = build_parser().parse_args(argv)
    model, _, work = workload(args)
    eng = LLMEngine(EngineConfig(model=model, **engine_kwargs(args)))
    r = redis.Redis.from_url(url)
    key = Keys().results(JOB_ID)
    for i, req in enumerate(work):
        eng.add_request(f"floor-{i}", list(req.prompt_token_ids), SamplingParams(**params(req)))
    seq = 0
    while eng.has_unfinished_requests():
        tokens = sum(len(d.new_token_ids) for d in eng.step())
        ts = time.time()
        if tokens:   # one event carrying as many ids as the step made tokens: see FloorReader
            r.xadd(key, {EVENT_FIELD: encode_token_event(seq, 0, seq, "x", [5] * tokens, None,
                                                         ts)})
            seq += 1
    r.xadd(key, {EVENT_FIELD: encode_event(DoneEvent(finish_reason="length"))})


def measure_floor(argv: list[str]) -> Floor:
    """The floor's delivery delays (one per token the engine made, as the worker benchmark has
    one per token event) and the wake probe, on a private redis-server."""
    from devtools.redis_server import RedisServer
    with RedisServer(["--appendonly", "no"]) as srv:
        reader = floor_reader(srv.url)
        reader.start()
        subprocess.run([sys.executable, "-m", "benchmarks.delivery_floor", "--write", srv.url,
                        *argv], cwd=REPO, check=True, timeout=1800)
        reader.join(30)
        if reader.error:
            raise reader.error
        stamps = reader.stamps
        step = (statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
                if len(stamps) > 1 else WAKE_GAP_S[0])
        step = min(max(step, WAKE_GAP_S[0]), WAKE_GAP_S[1])
        return Floor(reader.delays, step, wake_probe(srv.url, step, WAKE_PINGS))


def wake_probe(url: str, gap_s: float, count: int) -> list[float]:
    """``count`` round trips (seconds) of one PING, each sent after ``gap_s`` of silence, on a
    bare connection (hiredis, no redis-py callbacks, as the benchmark's reader): what waking
    redis-server and then this process costs when both slept that long (see the module
    docstring)."""
    r = redis.Redis.from_url(url, socket_timeout=30)
    conn = r.connection_pool.make_connection()
    try:
        conn.connect()
        out = []
        for _ in range(count):
            time.sleep(gap_s)
            t0 = time.perf_counter()
            conn.send_packed_command([b"*1\r\n$4\r\nPING\r\n"], check_health=False)
            conn.read_response()
            out.append(time.perf_counter() - t0)
        return out
    finally:
        conn.disconnect()
        r.close()


def floor_reader(url: str) -> "threading.Thread":
    """The worker benchmark's Reader, counting each event's delay once per token it carries:
    the worker writes one event per running job per step, all with the same ``ts``, so its
    percentiles are over tokens; the floor's must be too (a step that made 48 tokens weighs
    48 times one that made 1)."""
    from benchmarks.worker import Reader

    class FloorReader(Reader):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            self.stamps: list[float] = []  # each event's ts: one a step, their gaps the steps

        def _event(self, key: str, ev: Any, now: float) -> None:
            if ev.get("type") == "token":
                self.delays += [now - ev["ts"]] * (len(ev["token_ids"]) - 1)
                self.stamps.append(ev["ts"])
            super()._event(key, ev, now)
    return FloorReader(url, Keys(), [JOB_ID])


def report(floor: Floor) -> list[str]:
    from benchmarks.worker import pct
    d, w = floor.delays, floor.wakes
    return [f"delivery floor    : p50 {pct(d, 0.5):.2f} ms  p99 {pct(d, 0.99):.2f} ms  "
            f"max {max(d) * 1000:.2f} ms over {len(d)} tokens (the engine alone, one XADD per "
            f"step, the same reader: benchmarks.delivery_floor)",
            f"wake-up floor     : p50 {pct(w, 0.5):.2f} ms  p99 {pct(w, 0.99):.2f} ms  "
            f"max {max(w) * 1000:.2f} ms over {len(w)} PINGs, each after "
            f"{floor.step_s * 1000:.1f} ms of silence (the engine's median step)"]


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--write"]:
        write(argv[1], argv[2:])
        return 0
    print("\n".join(report(measure_floor(argv))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
