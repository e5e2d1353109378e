"""``python -m benchmarks.redis_memory``: the Redis memory one finished job holds.

A job's result stream, owner record and dedupe record stay in Redis for ``--result-ttl`` after
its last write (the job entry itself is deleted at its ack), so ``maxmemory`` must hold every job
finished within one TTL. This runs real jobs through an in-process worker on a private
redis-server (the tiny checkpoint by default: a real byte-level BPE tokenizer, so token ids and
text per token are of realistic size; ``--model fake:`` for no model at all) and prints, per
output length and ``stream`` setting, the bytes ``MEMORY USAGE`` reports for each per-job key and
the growth of ``used_memory`` per job. Not a test: it prints measured figures.
"""

from __future__ import annotations

import argparse
import statistics
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from tokenrelay.producer_sdk import Client
from tokenrelay.protocol.keys import Keys
from devtools.redis_server import RedisServer

REPO = Path(__file__).resolve().parent.parent
PROMPT = "Summarise the design of a message-queue-driven inference service in one paragraph:"


@dataclass
class Footprint:
    tokens: int
    stream: bool
    jobs: int
    per_key: dict[str, float]       # mean MEMORY USAGE bytes per key kind
    used_memory_per_job: float      # INFO used_memory growth / jobs
    entries: float                  # mean result-stream length

    @property
    def total(self) -> float:
        return sum(self.per_key.values())


def default_model() -> str:
    from demos.service import DEFAULT_MODEL_DIR, ensure_model
    return str(ensure_model(DEFAULT_MODEL_DIR, "llama"))


def run_jobs(url: str, namespace: str, model: str, tokens: int, stream: bool, jobs: int) -> Keys:
    """Start a worker, run ``jobs`` jobs of exactly ``tokens`` output tokens, stop the worker."""
    from tokenrelay.worker.config import WorkerSettings
    from tokenrelay.worker.service import Worker
    settings = WorkerSettings(redis_url=url, namespace=namespace, worker_id="mem", model=model,
                              max_num_seqs=16, enforce_eager=True)
    w = Worker(settings)
    t = threading.Thread(target=w.run, daemon=True)
    t.start()
    try:
        assert w.ready.wait(120), "worker not ready"
        with Client(redis_url=url, namespace=namespace) as client:
            handles = [client.submit(PROMPT, max_tokens=tokens, min_tokens=tokens,
                                     ignore_eos=True, temperature=0.0, stream=stream,
                                     metadata={"user": f"u{i}"}) for i in range(jobs)]
            for h in handles:
                h.result(timeout=300)
    finally:
        w.stop()
        t.join(30)
    return Keys(namespace)


def per_job_keys(r: redis.Redis, keys: Keys) -> dict[str, list[str]]:
    """Every per-job key left in the namespace, by kind (result, owner, job, cancel)."""
    out: dict[str, list[str]] = {}
    for key in r.scan_iter(match=f"{keys.namespace}:*:{{*}}:*", count=1000):
        kind = key.decode().split(":")[1]
        if kind in ("result", "owner", "job", "cancel"):   # not the lanes (<ns>:jobs:{q}:...)
            out.setdefault(kind, []).append(key)
    return out


def measure(url: str, model: str, tokens: int, stream: bool, jobs: int) -> Footprint:
    r = redis.Redis.from_url(url)
    ns = f"mem{tokens}{'s' if stream else 'n'}{jobs}"
    before = int(r.info("memory")["used_memory"])
    keys = run_jobs(url, ns, model, tokens, stream, jobs)
    after = int(r.info("memory")["used_memory"])
    found = per_job_keys(r, keys)
    per_key = {kind: statistics.fmean(r.memory_usage(k, samples=0) or 0 for k in names)
               * len(names) / jobs for kind, names in found.items()}
    entries = statistics.fmean(r.xlen(k) for k in found.get("result", [])) if found else 0.0
    return Footprint(tokens, stream, jobs, per_key, (after - before) / jobs, entries)


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.redis_memory", description=__doc__)
    p.add_argument("--model", default=None, help="checkpoint folder or fake: (default: tiny)")
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 256])
    p.add_argument("--node-bytes", type=int, nargs="+", default=[4096, 1024],
                   help="redis-server stream-node-max-bytes values to compare (4096: Redis' "
                        "default; compose.yaml sets 1024)")
    args = p.parse_args(argv)
    model = args.model or default_model()
    print(f"model {model}, {args.jobs} jobs per row; bytes per job")
    print(f"{'node':>5} {'tokens':>6} {'stream':>6} {'entries':>7} {'result':>8} {'owner':>6} "
          f"{'job':>6} {'keys total':>10} {'used_memory/job':>15}")
    for node_bytes in args.node_bytes:
        with RedisServer(["--appendonly", "no", "--stream-node-max-bytes", str(node_bytes)]) \
                as server:
            measure(server.url, model, 8, True, 5)   # warm-up: scripts, group, connections
            for tokens in args.tokens:
                for stream in (True, False):
                    print_row(node_bytes, measure(server.url, model, tokens, stream, args.jobs))
    return 0


def print_row(node_bytes: int, f: Footprint) -> None:
    k = f.per_key
    print(f"{node_bytes:>5} {f.tokens:>6} {str(f.stream):>6} {f.entries:>7.1f} "
          f"{k.get('result', 0):>8.0f} {k.get('owner', 0):>6.0f} {k.get('job', 0):>6.0f} "
          f"{f.total:>10.0f} {f.used_memory_per_job:>15.0f}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
