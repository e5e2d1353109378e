"""``python -m benchmarks.step_script``: what the step script (``WRITE_STEP``) costs Redis.

Every engine step the worker writes each held job's events with one ``WRITE_STEP`` call per
queue shard and 128 jobs (worker/outbox.py). Since issue #25 every one of those writes is
checked against the stream's length (``XLEN``, O(1)), so a Redis restart that lost acknowledged
events is found even when the worker saw no error. This
prints what the script costs per step and per job with that check, measured on a private
redis-server: ``--jobs`` result streams, one token event each per step, for ``--steps`` steps,
the marks tracked as the worker tracks them. Figures: the server's own time per call (``INFO
commandstats``, evalsha: not inflated by a loaded client machine) and the client's wall time
per step (a round trip).

``--unchecked`` sends ``expect`` = '' (the plain append of the scripts before #25, which
checked only after an error): run it that way, from a copy of this file outside the repository,
against a checkout from before the change (``PYTHONPATH=<old checkout>``) for the "before"
figure; the current script fails on it (its ``known`` is a count). Not a test: it
prints measured figures.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Optional

import redis

from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.scripts import ScriptPipeline
from tokenrelay.worker.fencing import Fence, WriteStatus, parse_step_reply
from devtools.redis_server import RedisServer

CHUNK = 128   # jobs per WRITE_STEP call, as worker/outbox.py sends them
EVENT = b"x" * 60   # about one encoded token event


def own_jobs(r: Any, keys: Keys, fence: Fence, n: int) -> list[str]:
    """``n`` jobs with a lane entry each, bound and owned by one worker; returns the ids."""
    lane = keys.lane("default")
    ids = [f"bench-{i}" for i in range(n)]
    pipe = ScriptPipeline(r)
    for job_id in ids:
        entry_id = r.xadd(lane, {"p": b"x"}).decode()
        fence.bind_and_own(pipe, job_id, 0, lane, entry_id, f"w:{job_id}", 600_000)
    pipe.execute()
    return ids


def run_steps(r: Any, fence: Fence, ids: list[str], steps: int, unchecked: bool
              ) -> list[float]:
    """Write ``steps`` steps; returns each step's wall seconds. Raises on any status but ok.
    Before step ``k`` every stream holds ``k`` entries (what the worker passes as ``known``)."""
    walls = []
    for step in range(steps):
        known: Any = "" if unchecked else step
        pipe = ScriptPipeline(r)
        for k in range(0, len(ids), CHUNK):
            fence.write_step(pipe, 600_000, 0, [
                (j, f"w:{j}", f"b.{step}", [EVENT], step == 0, known, False)
                for j in ids[k:k + CHUNK]])
        t0 = time.perf_counter()
        replies = pipe.execute()
        walls.append(time.perf_counter() - t0)
        for reply in replies:
            bad = [s for s, _, _ in parse_step_reply(reply) if s is not WriteStatus.OK]
            if bad:
                raise RuntimeError(f"step {step}: {len(bad)} writes answered {bad[0].value}")
    return walls


def measure(jobs: int, steps: int, unchecked: bool) -> dict[str, float]:
    with RedisServer(["--appendonly", "no"]) as srv:
        r = redis.Redis.from_url(srv.url)
        keys = Keys("bench", "q")
        fence = Fence(keys)
        ids = own_jobs(r, keys, fence, jobs)
        r.config_resetstat()
        walls = run_steps(r, fence, ids, steps, unchecked)
        stats = r.info("commandstats").get("cmdstat_evalsha", {})
        r.close()
    calls = max(1, int(stats.get("calls", 0)))
    usec = float(stats.get("usec", 0))
    return {"server_us_per_step": usec / steps, "server_us_per_job": usec / steps / jobs,
            "server_us_per_call": usec / calls,
            "wall_ms_p50": statistics.median(walls) * 1000,
            "wall_ms_mean": statistics.fmean(walls) * 1000}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_script",
                                description=__doc__.split("\n")[0])
    p.add_argument("--jobs", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--unchecked", action="store_true",
                   help="expect '' (the pre-#25 plain append, only against an older checkout; "
                        "see the module docstring)")
    args = p.parse_args(argv)
    mode = "unchecked" if args.unchecked else "checked"
    print(f"{'jobs':>6} {'mode':>9} {'server us/step':>15} {'us/job':>7} {'us/call':>8} "
          f"{'wall ms p50':>12} {'mean':>7}")
    for n in args.jobs:
        m = measure(n, args.steps, args.unchecked)
        print(f"{n:>6} {mode:>9} {m['server_us_per_step']:>15.0f} {m['server_us_per_job']:>7.2f} "
              f"{m['server_us_per_call']:>8.0f} {m['wall_ms_p50']:>12.2f} {m['wall_ms_mean']:>7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
