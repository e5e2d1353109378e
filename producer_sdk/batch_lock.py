"""One batch run per output file at a time.

Why: two runs of the same batch at once both read the output to learn what was done, then both
append every line they finish: 40 requests gave 77-80 output lines (issue #25). A second run
now refuses at once, naming the run that holds the file.

The lock is ``flock`` on ``<output>.lock``, which the kernel releases when its holder exits,
however it exits: a crashed or killed run never blocks the next one. The file keeps the
holder's pid and host for the message (it is not removed: removing a lock file races with a
run that just opened it).
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import Any, Optional


class BatchLocked(RuntimeError):
    """Another run is writing this output file now."""


class OutputLock:
    """Exclusive, non-blocking lock of one output file for the life of a ``with`` block."""

    def __init__(self, output: Path) -> None:
        self.path = output.with_name(output.name + ".lock")
        self.output = output
        self._fd: Optional[int] = None

    def __enter__(self) -> "OutputLock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise BatchLocked(
                f"another batch run ({holder}) is writing {self.output} now; wait for it to "
                f"finish (a rerun then resumes where it stopped) or stop it first") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fd is not None:
            os.close(self._fd)          # closing the descriptor releases the flock
            self._fd = None


__all__ = ["BatchLocked", "OutputLock"]
