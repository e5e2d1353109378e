"""Fleet benchmark: how much one Redis, and a Redis Cluster with a sharded queue, carry as
fake-engine workers are added.

``python -m benchmarks.fleet [--workers 1,2,4,8] [--jobs 2000] [--max-tokens 32]
[--cluster-masters 3] [--shards 3] [--out docs/bench]``

For each fleet size and each backend (one private redis-server; then a private cluster of
``--cluster-masters`` masters with the queue split into ``--shards`` shards): that many
``tokenrelay worker --model fake:`` processes (the FakeEngine: no model, tokens as fast as the
service can move them), all jobs submitted at once with ``submit_many`` (streamed, one token
event per token), and the clock stopped when the consumer group has acked every job (a job is
acked only after its terminal event is written).

Printed: jobs/s, token events/s, the CPU the workers used and the CPU of the busiest redis-server
per wall second (cores). Redis runs commands on one thread, so a redis-server is saturated at
one core: ``ceiling jobs/s`` = jobs/s / busiest server's cores is the rate at which the busiest
server would reach that core, i.e. what the Redis side sustains once workers are on machines of
their own. On a small host the workers saturate the host first (measured jobs/s stops rising
while the servers stay well under a core); the ceiling still tells how far one Redis and the
cluster would go.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from tokenrelay.producer_sdk import Client
from tokenrelay.protocol.keys import GROUP, Keys
from tokenrelay.protocol.topology import make_client
from devtools.redis_server import RedisCluster, RedisServer


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _acked_all(r: Any, keys: Keys) -> bool:
    for lane in keys.lanes():
        if not r.exists(lane):
            continue
        for g in r.xinfo_groups(lane):
            name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
            if name == GROUP and (g.get("pending") or g.get("lag")):
                return False
    return True


class Backend:
    """One redis-server, or a cluster of ``masters`` masters: its URL and server pids."""

    def __init__(self, masters: int) -> None:
        self.masters = masters
        self.server: Optional[RedisServer] = None
        self.cluster: Optional[RedisCluster] = None

    def start(self) -> "Backend":
        if self.masters <= 1:
            self.server = RedisServer(["--appendonly", "no"]).start()
        else:
            self.cluster = RedisCluster(self.masters).start()
        return self

    @property
    def url(self) -> str:
        return self.server.url if self.server else self.cluster.url

    def pids(self) -> list[int]:
        nodes = [self.server] if self.server else self.cluster.nodes
        return [n.proc.pid for n in nodes]

    def stop(self) -> None:
        if self.server:
            self.server.stop()
        if self.cluster:
            self.cluster.stop()


def run_fleet(n_workers: int, jobs: int, max_tokens: int, max_num_seqs: int,
              masters: int = 1, shards: int = 1) -> dict[str, Any]:
    backend = Backend(masters).start()
    procs: list[subprocess.Popen] = []
    try:
        for i in range(n_workers):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tokenrelay.worker", "--model", f"fake:max_num_seqs={max_num_seqs}",
                 "--redis-url", backend.url, "--shards", str(shards), "--worker-id",
                 f"fleet-{i}", "--log-level", "warning", "--block-ms", "20"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        keys = Keys(shards=shards)
        r = make_client(backend.url)
        deadline = time.monotonic() + 60
        while r.zcard(keys.workers) < n_workers:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"only {r.zcard(keys.workers)} of {n_workers} workers started")
            time.sleep(0.1)
        cpu0 = {p.pid: _cpu_seconds(p.pid) for p in procs}
        server_cpu0 = {pid: _cpu_seconds(pid) for pid in backend.pids()}
        with Client(backend.url, shards=shards) as client:
            start = time.perf_counter()
            client.submit_many([f"fleet job {i}" for i in range(jobs)], max_tokens=max_tokens,
                               ignore_eos=True, temperature=0.0)
            while not _acked_all(r, keys):
                time.sleep(0.02)
            wall = time.perf_counter() - start
        workers_cpu = sum(_cpu_seconds(p.pid) - cpu0[p.pid] for p in procs)
        server_cores = [(_cpu_seconds(pid) - c0) / wall for pid, c0 in server_cpu0.items()]
        jobs_s = jobs / wall
        busiest = max(server_cores)
        return {"workers": n_workers, "masters": masters, "shards": shards, "jobs_s": jobs_s,
                "tokens_s": jobs * max_tokens / wall, "wall_s": wall,
                "server_cores": server_cores, "busiest_cores": busiest,
                "ceiling_jobs_s": jobs_s / busiest if busiest > 0 else float("inf"),
                "worker_cores": workers_cpu / wall}
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=10)
        backend.stop()


def _row(name: str, f: dict[str, Any], max_tokens: int) -> str:
    servers = "/".join(f"{c:.2f}" for c in f["server_cores"])
    return (f"{name:>22} {f['workers']:7d} {f['jobs_s']:8.1f} {f['tokens_s']:15.0f} "
            f"{f['worker_cores']:12.2f} {servers:>16} {f['ceiling_jobs_s']:13.0f} "
            f"{f['ceiling_jobs_s'] * max_tokens:16.0f}")


def plot(rows: list[tuple[str, dict[str, Any]]], path: Path, note: str) -> Optional[Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'tokenrelay[bench]')")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict(rows):
        mine = [f for n, f in rows if n == name]
        workers = [f["workers"] for f in mine]
        axes[0].plot(workers, [f["tokens_s"] for f in mine], marker="o", label=name)
        axes[1].plot(workers, [f["ceiling_jobs_s"] * f["tokens_s"] / f["jobs_s"] for f in mine],
                     marker="o", label=name)
    axes[0].set_ylabel("token events/s measured")
    axes[1].set_ylabel("token events/s at one core of the busiest server")
    for ax in axes:
        ax.set_xlabel("fake-engine workers")
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"what one Redis and a Redis Cluster carry\n{note}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fleet",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--workers", default="1,2,4,8", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="per fake worker")
    ap.add_argument("--cluster-masters", type=int, default=3,
                    help="masters of the cluster backend (0: one redis-server only)")
    ap.add_argument("--shards", type=int, default=3, help="shards of the queue on the cluster")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for fleet.json and fleet.png (e.g. docs/bench)")
    args = ap.parse_args(argv)
    print(f"{args.jobs} jobs of {args.max_tokens} streamed tokens, fake engine "
          f"(max_num_seqs={args.max_num_seqs}); host cores: {os.cpu_count()}")
    print(f"{'backend':>22} {'workers':>7} {'jobs/s':>8} {'token events/s':>15} "
          f"{'worker cores':>12} {'server cores':>16} {'ceiling jobs/s':>13} "
          f"{'ceiling events/s':>16}")
    backends = [("one redis-server", 1, 1)]
    if args.cluster_masters > 1:
        backends.append((f"cluster {args.cluster_masters}m, {args.shards} shards",
                         args.cluster_masters, args.shards))
    rows: list[tuple[str, dict[str, Any]]] = []
    for n in args.workers:
        for name, masters, shards in backends:
            f = run_fleet(n, args.jobs, args.max_tokens, args.max_num_seqs, masters, shards)
            rows.append((name, f))
            print(_row(name, f, args.max_tokens), flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        note = (f"{args.jobs} jobs x {args.max_tokens} streamed tokens, fake engine, "
                f"{os.cpu_count()}-core host")
        (args.out / "fleet.json").write_text(json.dumps(
            {"note": note, "rows": [{"backend": n, **f} for n, f in rows]}, indent=1))
        made = plot(rows, args.out / "fleet.png", note)
        print(f"wrote {args.out / 'fleet.json'}" + (f" and {made}" if made else ""))


if __name__ == "__main__":
    main()
