"""One batch run per output file at a time.

Why: two runs of the same batch at once both read the output to learn what was done, then both
append every line they finish: 40 requests gave 77-80 output lines (issue #25). A second run
now refuses at once, naming the run that holds the file.

The lock is ``flock`` on the output file itself, so it is keyed by the file (its device and
inode), not by the name it was given: a run through a symlink, a hard link or a relative path
meets the same lock (issue #42: the same file written by two runs through a symlink, 60 lines
for 30 requests). The kernel releases it when its holder exits, however it exits: a crashed or
killed run never blocks the next one. The holder's pid and host go to ``<resolved output>.lock``
for the message only (it is not removed: removing it races with a run that just opened it); a
run that reached the file by another hard link does not find that note, and says so.
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
    """Exclusive, non-blocking lock of one output file for the life of a ``with`` block (the
    file is created empty when it does not exist yet)."""

    def __init__(self, output: Path) -> None:
        self.output = output
        resolved = output.resolve()
        self.note = resolved.with_name(resolved.name + ".lock")
        self._fd: Optional[int] = None

    def __enter__(self) -> "OutputLock":
        fd = os.open(self.output, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise BatchLocked(
                f"another batch run ({self._holder()}) is writing {self.output} now; wait for "
                f"it to finish (a rerun then resumes where it stopped) or stop it first") from None
        self._fd = fd
        self.note.write_text(f"pid {os.getpid()} on {socket.gethostname()}\n")
        return self

    def _holder(self) -> str:
        try:
            return self.note.read_text(errors="replace").strip() or "unknown"
        except FileNotFoundError:
            return "it reached the same file by another hard link"

    def __exit__(self, *exc: Any) -> None:
        if self._fd is not None:
            os.close(self._fd)          # closing the descriptor releases the flock
            self._fd = None


__all__ = ["BatchLocked", "OutputLock"]
