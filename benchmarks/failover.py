"""Gateway streams through failovers of the master the gateway's ``--redis-url`` names (#42).

``python -m benchmarks.failover [--trials 20] [--streams 16] [--tokens 300] [--step-delay 0.02]``

Starts a private Redis Cluster (3 masters, 1 replica each), one fake worker (whose URL names
another node) and one ``tokenrelay gateway --shards 3`` whose ``--redis-url`` names node 0.
Each trial opens ``--streams`` streamed completions (their jobs on all three shards), and once
every stream has its first chunks SIGKILLs node 0, a master, while they stream; its replica
takes over and every stream is read to its end. A stream is broken when its status is not 200,
it carries an error event, it lacks ``[DONE]`` or its text is not the fake engine's completion.
Node 0 then restarts (it rejoins as a replica) and takes its slots back (``CLUSTER
FAILOVER``), so the next trial kills the URL's node again. Printed: per trial the broken
streams (0 expected), the seconds the replica took to take over and the slowest stream. The
host is shared: the seconds are noisy, the broken counts are not.
``tests/faults/test_gateway_failover.py`` runs a few trials of this with the suite.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import httpx

from tokenrelay.worker.fake_engine import fake_completion
from devtools.redis_server import RedisCluster, free_port

NS = "failover"
URL_NODE = 0            # the node the gateway's --redis-url names
URL_NODE_SLOT = 0       # a slot of its own (redis-cli gives master i the i-th third)


@dataclass
class TrialResult:
    broken: list[str]
    takeover_s: float
    slowest_s: float


@dataclass
class FailoverStack:
    """The cluster, the worker and the gateway of a run; ``stop()`` ends every process."""

    log_dir: Path
    step_delay: float = 0.02
    cluster: RedisCluster = field(default_factory=lambda: RedisCluster(masters=3, replicas=1))
    procs: list[subprocess.Popen] = field(default_factory=list)
    url: str = ""

    def start(self) -> "FailoverStack":
        try:
            self.cluster.start(timeout=60)
            self._spawn("worker", ["tokenrelay.worker", "--model",
                                   f"fake:max_num_seqs=64,step_delay={self.step_delay}",
                                   "--redis-url", self.cluster.urls()[1], "--namespace", NS,
                                   "--queue", "fq", "--shards", "3", "--worker-id", "w0"])
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            self._spawn("gateway", ["tokenrelay.producer_sdk.gateway", "--redis-url",
                                    self.cluster.urls()[URL_NODE], "--namespace", NS,
                                    "--shards", "3", "--port", str(port),
                                    "--status-wait-s", "0.2"])
            self._wait_for_model(90)
            return self
        except BaseException:
            self.stop()
            raise

    def _spawn(self, name: str, args: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENRELAY_")}
        log = open(self.log_dir / f"{name}.log", "ab")
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", *args, "--log-level", "warning"], stdout=log,
            stderr=subprocess.STDOUT, env={**env, "PYTHONUNBUFFERED": "1"},
            start_new_session=True))

    def _wait_for_model(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a process exited; logs in {self.log_dir}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).json().get("data"):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the gateway or the worker did not come up; logs in {self.log_dir}")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.cluster.stop()

    # -- the URL's node: killed, then made master again
    def kill_url_node(self) -> float:
        """SIGKILL node 0; seconds until another node serves its slots."""
        self.cluster.kill(URL_NODE)
        t0 = time.monotonic()
        self._until(lambda: self.cluster.master_of_slot(URL_NODE_SLOT) != URL_NODE, 30,
                    "a replica took over the URL node's slots")
        return time.monotonic() - t0

    def restore_url_node(self) -> None:
        """Restart node 0 (a replica now) and hand it its slots back."""
        node = self.cluster.nodes[URL_NODE]
        node.start()
        self._until(lambda: _replica_in_sync(self.cluster, URL_NODE), 30, "node 0 in sync")
        self.cluster.client(URL_NODE).execute_command("CLUSTER", "FAILOVER")
        self._until(lambda: self.cluster.master_of_slot(URL_NODE_SLOT) == URL_NODE, 30,
                    "node 0 master again")
        self.cluster.wait_ok(30)

    @staticmethod
    def _until(check: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out: {what}")
            time.sleep(0.1)


def _replica_in_sync(cluster: RedisCluster, i: int) -> bool:
    info = cluster.client(i).info("replication")
    return info.get("role") == "slave" and info.get("master_link_status") == "up"


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, tokens: int,
                  flowing: asyncio.Event, counts: list[int]) -> Optional[str]:
    """Read one stream to its end: None when whole and exact, else what broke."""
    body = {"model": "fake", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "stream": True}
    text, done = [], False
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            return f"{prompt}: HTTP {resp.status_code}"
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                obj = json.loads(line[6:])
                if "error" in obj:
                    return f"{prompt}: error event {obj['error']}"
                text.append(obj["choices"][0]["text"] if obj["choices"] else "")
                if len(text) == 3:
                    counts[0] += 1
                    if counts[0] == counts[1]:
                        flowing.set()
    if not done or "".join(text) != fake_completion(prompt, tokens):
        return f"{prompt}: {'no [DONE]' if not done else 'wrong text'} ({len(text)} chunks)"
    return None


async def run_trial(stack: FailoverStack, trial: int, streams: int, tokens: int) -> TrialResult:
    """One kill of the URL's node under ``streams`` live streams; the stack restored after."""
    flowing, counts = asyncio.Event(), [0, streams]
    url = f"{stack.url}/v1/completions"
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=10)) as client:
        tasks = [asyncio.create_task(_stream(client, url, f"t{trial} s{i}", tokens, flowing,
                                             counts)) for i in range(streams)]
        await asyncio.wait_for(flowing.wait(), 60)
        takeover = await asyncio.to_thread(stack.kill_url_node)
        outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 150)
    slowest = time.monotonic() - t0
    broken = [o if isinstance(o, str) else f"raised {o!r}" for o in outcomes if o is not None]
    await asyncio.to_thread(stack.restore_url_node)
    return TrialResult(broken, takeover, slowest)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--step-delay", type=float, default=0.02)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tokenrelay-failover-") as tmp:
        stack = FailoverStack(Path(tmp), args.step_delay).start()
        total = 0
        try:
            for trial in range(args.trials):
                r = asyncio.run(run_trial(stack, trial, args.streams, args.tokens))
                total += len(r.broken)
                print(f"trial {trial + 1:3d}: broken {len(r.broken):2d}/{args.streams}  "
                      f"takeover {r.takeover_s:5.2f} s  slowest stream {r.slowest_s:5.2f} s",
                      flush=True)
                for why in r.broken[:3]:
                    print(f"    {why}", flush=True)
        finally:
            stack.stop()
    print(f"broken streams: {total} of {args.trials * args.streams} in {args.trials} trials")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
