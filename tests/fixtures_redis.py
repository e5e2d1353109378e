"""Redis fixtures: a private ``redis-server`` per test and a ``tokenrelay worker`` subprocess helper.

Tests never touch the shared Redis on 6379: each gets its own server on a free port with its own
data directory, so AOF, restarts and ``kill -9`` are safe to exercise. Everything started here is
killed at teardown, also when the test fails.

Usable by any test module (the plugin is loaded by tests/conftest.py):

    def test_x(redis_server):                      # fresh server, no persistence
        r = redis_server.client()
    def test_y(redis_server_factory):
        srv = redis_server_factory("--appendonly", "yes", "--appendfsync", "always")
        srv.kill()                                  # kill -9
        srv.start()                                 # same port, same dir (AOF reloaded)
    def test_z(redis_server, worker_process):
        w = worker_process("--model", path, "--redis-url", redis_server.url)
        w.wait_for_log("worker ready")
        w.terminate(); assert w.wait(30) == 0
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest

REDIS_SERVER_BIN = os.environ.get("TOKENRELAY_TEST_REDIS_SERVER") or shutil.which(
    "redis-server") or "/usr/bin/redis-server"
REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RedisServer:
    """One redis-server process. ``start()`` again after ``kill()``/``stop()`` reuses port and dir."""

    dir: Path
    extra_args: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    proc: Optional[subprocess.Popen] = None
    binary: str = REDIS_SERVER_BIN       # tests/fault_harness.REDIS_62 for Redis 6.2

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.dir), "--save", "", "--daemonize", "no",
                "--protected-mode", "no", "--logfile", str(self.dir / "redis.log"),
                *self.extra_args]

    def start(self, timeout: float = 10.0) -> "RedisServer":
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self._wait_ready(timeout)
        return self

    def _wait_ready(self, timeout: float) -> None:
        import redis
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; log:\n"
                                   + self.log_tail())
            try:
                with redis.Redis(port=self.port, socket_timeout=1) as r:
                    if r.ping():
                        return
            except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
                time.sleep(0.02)  # ResponseError: still LOADING the AOF
        raise TimeoutError(f"redis-server on port {self.port} not ready in {timeout}s")

    def client(self, **kw) -> "redis.Redis":  # noqa: F821
        import redis
        return redis.Redis(port=self.port, **kw)

    def version(self) -> tuple[int, ...]:
        with self.client() as r:
            return tuple(int(x) for x in r.info("server")["redis_version"].split("."))

    def kill(self) -> None:
        """SIGKILL: no AOF rewrite, no goodbye (what a crash looks like)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        """Graceful SIGTERM shutdown (flushes the AOF)."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self, down_for: float = 0.0, hard: bool = True) -> None:
        self.kill() if hard else self.stop()
        time.sleep(down_for)
        self.start()

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join((self.dir / "redis.log").read_text().splitlines()[-n:])
        except OSError:
            return ""


def start_redis_server(directory: Path, *extra_args: str) -> RedisServer:
    """Start a server on a free port (retrying if another process grabs the port first)."""
    last: Optional[Exception] = None
    for _ in range(5):
        srv = RedisServer(dir=Path(directory), extra_args=tuple(extra_args))
        try:
            return srv.start()
        except (RuntimeError, TimeoutError) as exc:
            last = exc
            srv.kill()
    raise RuntimeError(f"could not start redis-server: {last}")


@pytest.fixture
def redis_server_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    servers: list[RedisServer] = []

    def make(*extra_args: str) -> RedisServer:
        srv = start_redis_server(tmp_path / f"redis{len(servers)}", *extra_args)
        servers.append(srv)
        return srv

    try:
        yield make
    finally:
        for srv in servers:
            srv.kill()


@pytest.fixture
def redis_server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    return redis_server_factory()


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[Any]:
    """A 3-master Redis Cluster (devtools.redis_server.RedisCluster) for one test module: starting
    one costs ~2 s, so a module's tests share it, each in a namespace (or queue) of its own."""
    from devtools.redis_server import RedisCluster
    c = RedisCluster(masters=3).start()
    try:
        yield c
    finally:
        c.stop()


# --------------------------------------------------------------------------------------------
# tokenrelay worker as a subprocess
# --------------------------------------------------------------------------------------------

@dataclass
class WorkerProcess:
    """A worker child with its stderr (JSON logs) captured to a file: ``python -m
    tests.fault_worker``, i.e. ``tokenrelay worker`` plus test-only fault injection
    (TOKENRELAY_FAULT_INJECT, tests/fault_harness.py)."""

    args: tuple[str, ...]
    log_path: Path
    env: dict[str, str]
    proc: Optional[subprocess.Popen] = None
    module: str = "tests.fault_worker"

    def start(self) -> "WorkerProcess":
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args],
                                     cwd=str(REPO_ROOT), env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_for_log(self, needle: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.log():
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited ({self.proc.returncode}) before {needle!r}:\n"
                                   + self.log()[-3000:])
            time.sleep(0.05)
        raise TimeoutError(f"{needle!r} not in worker log after {timeout}s:\n" + self.log()[-3000:])

    def signal(self, sig: int) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def terminate(self) -> None:
        self.signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL the whole process group (the worker and anything it spawned)."""
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        if getattr(self, "_log", None):
            self._log.close()


@pytest.fixture
def worker_process(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Factory ``worker_process(*args, env=None)``; every process it started is killed at teardown."""
    started: list[WorkerProcess] = []

    def start(*args: str, env: Optional[dict[str, str]] = None) -> WorkerProcess:
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        wp = WorkerProcess(args=tuple(args), log_path=tmp_path / f"worker{len(started)}.log",
                           env=full_env)
        started.append(wp)
        return wp.start()

    try:
        yield start
    finally:
        for wp in started:
            wp.kill()


# --------------------------------------------------------------------------------------------
# in-process workers (a Worker thread on the contract-shaped FakeEngine)
# --------------------------------------------------------------------------------------------

FAST = dict(block_ms=50, heartbeat_ms=200, drain_timeout=5.0, result_ttl=120.0)


@dataclass
class Running:
    worker: Any
    thread: threading.Thread
    result: list

    def stop(self, force: bool = False, timeout: float = 15.0) -> int:
        self.worker.stop(force=force)
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "worker did not stop"
        return self.result[0] if self.result else -1


@pytest.fixture
def start_worker(redis_server) -> Iterator[Callable[..., Running]]:
    """Start in-process workers on ``redis_server``; all are force-stopped at teardown."""
    running: list[Running] = []

    def start(engine: Any = None, worker_id: str = "w1", wait: bool = True,
              **overrides: Any) -> Running:
        from tokenrelay.worker.config import WorkerSettings
        from tokenrelay.worker.fake_engine import FakeEngine
        from tokenrelay.worker.service import Worker
        settings = WorkerSettings(**{"redis_url": redis_server.url, "worker_id": worker_id,
                                     "model": "fake:", **FAST, **overrides})
        w = Worker(settings, engine=engine if engine is not None else FakeEngine())
        result: list = []
        t = threading.Thread(target=lambda: result.append(w.run()), daemon=True,
                             name=f"worker-{worker_id}")
        t.start()
        r = Running(w, t, result)
        running.append(r)
        if wait:
            assert w.ready.wait(15), "worker not ready"
        return r

    yield start
    for r in running:
        r.worker.stop(force=True)
    for r in running:
        r.thread.join(15)
