"""Process and Redis helpers for the fault-tolerance tests.

Every process started here runs in its own process group and is registered with a ``Reaper`` that
kills the whole group at teardown, also when the test failed or timed out, so no redis-server or
worker outlives the test session.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import redis

REDIS_7 = "/usr/bin/redis-server"
REDIS_62 = str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "redis-server")


def free_port() -> int:
    """A TCP port nobody listens on right now (the usual bind-to-0 trick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal a child's whole process group; quiet if it is already gone."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Reaper:
    """Remembers started processes and kills their groups at teardown (SIGCONT first, so a
    SIGSTOPped process does not linger)."""

    procs: list[subprocess.Popen] = field(default_factory=list)

    def add(self, proc: subprocess.Popen) -> subprocess.Popen:
        self.procs.append(proc)
        return proc

    def reap(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                kill_group(proc, signal.SIGCONT)
                kill_group(proc, signal.SIGKILL)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs.clear()


@dataclass
class RedisServer:
    """A redis-server child on a free port; ``restart`` keeps port and data dir (for AOF tests)."""

    binary: str
    workdir: Path
    reaper: Reaper
    appendonly: bool = False
    port: int = field(default_factory=free_port)
    proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        return [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.workdir), "--save", "", "--daemonize", "no",
                "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "everysec",
                "--maxmemory-policy", "noeviction", "--loglevel", "warning"]

    def start(self) -> "RedisServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / "redis.log", "ab")
        self.proc = self.reaper.add(subprocess.Popen(
            self.args(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        client = redis.Redis(port=self.port, socket_timeout=1)
        while True:
            try:
                if client.ping():
                    # With AOF, loading may still be going on after the first PONG.
                    if int(client.info("persistence").get("loading", 0)) == 0:
                        return
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                pass
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; "
                                   f"see {self.workdir / 'redis.log'}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on port {self.port} not ready in {timeout}s")
            time.sleep(0.05)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None:
            kill_group(self.proc, sig)
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def client(self, **kwargs) -> redis.Redis:
        return redis.Redis(port=self.port, **kwargs)

    def version(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.client().info("server")["redis_version"].split("."))


def start_process(reaper: Reaper, argv: Sequence[str], log_path: Path,
                  env: Optional[dict[str, str]] = None, cwd: Optional[str] = None
                  ) -> subprocess.Popen:
    """Start a child in a new session (its own process group), output appended to ``log_path``."""
    log = open(log_path, "ab")
    return reaper.add(subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT,
                                       env=env, cwd=cwd, start_new_session=True))


def wait_for(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy; raise TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)
