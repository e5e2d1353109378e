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

    python -m benchmarks.delivery_floor [the options of benchmarks.worker]

``benchmarks.worker`` prints it after its own figures (``--no-floor`` skips it). Not a test:
it prints measured figures.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import redis

from protocol.events import DoneEvent, encode_event
from protocol.keys import EVENT_FIELD, Keys

REPO = Path(__file__).resolve().parent.parent
JOB_ID = "floor"


def write(url: str, argv: list[str]) -> None:
    """The writer process: the workload on the engine alone, one token event per step."""
    from benchmarks.worker import build_parser, engine_kwargs, params, workload
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from worker.jobs import encode_token_event
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


def measure_floor(argv: list[str]) -> list[float]:
    """Delivery delays (seconds), one per token the engine made (as the worker benchmark has
    one per token event), on a private redis-server."""
    from worker.redis_server import RedisServer
    with RedisServer(["--appendonly", "no"]) as srv:
        reader = floor_reader(srv.url)
        reader.start()
        subprocess.run([sys.executable, "-m", "benchmarks.delivery_floor", "--write", srv.url,
                        *argv], cwd=REPO, check=True, timeout=1800)
        reader.join(30)
        if reader.error:
            raise reader.error
        return reader.delays


def floor_reader(url: str) -> "threading.Thread":
    """The worker benchmark's Reader, counting each event's delay once per token it carries:
    the worker writes one event per running job per step, all with the same ``ts``, so its
    percentiles are over tokens; the floor's must be too (a step that made 48 tokens weighs
    48 times one that made 1)."""
    from benchmarks.worker import Reader

    class FloorReader(Reader):
        def _event(self, key: str, ev: Any, now: float) -> None:
            if ev.type == "token":
                self.delays += [now - ev.ts] * (len(ev.token_ids) - 1)
            super()._event(key, ev, now)
    return FloorReader(url, Keys(), [JOB_ID])


def report(delays: list[float]) -> str:
    from benchmarks.worker import pct
    return (f"delivery floor    : p50 {pct(delays, 0.5):.2f} ms  p99 {pct(delays, 0.99):.2f} ms  "
            f"max {max(delays) * 1000:.2f} ms over {len(delays)} tokens (the engine alone, one "
            f"XADD per step, the same reader: benchmarks.delivery_floor)")


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--write"]:
        write(argv[1], argv[2:])
        return 0
    print(report(measure_floor(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
