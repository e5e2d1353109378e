"""Child processes of an engine that must never outlive their parent: tensor-parallel ranks
(engine/parallel/rank.py) and the engine core's own process (engine/core_process.py).

Each is ``python -m <module>`` with this interpreter and import path; its stdin carries one
pickled spec and then stays open as its *lifeline*: only the parent holds the write end, so
end of file means the parent is gone, however it ended (a SIGKILL included). A thread in the
child waits for that and ends the process at once. Children ignore SIGINT and SIGTERM: a
Ctrl-C or a ``kill`` of the process group is for the parent to handle (the worker drains on
SIGTERM), and the child ends with it through the lifeline.
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
from typing import Any, BinaryIO, Optional, Sequence


def spawn(module: str, args: Sequence[str], spec: Any,
          pass_fds: Sequence[int] = ()) -> subprocess.Popen:
    """Start ``python -m module *args`` with ``spec`` written to its stdin (the lifeline)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                            env=env, pass_fds=tuple(pass_fds))
    proc.stdin.write(pickle.dumps(spec))
    proc.stdin.flush()
    return proc


def child_start() -> tuple[Any, BinaryIO]:
    """In the child: ignore SIGINT/SIGTERM, read the spec, and return it with the lifeline."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stdin = sys.stdin.buffer
    return pickle.load(stdin), stdin


def watch_lifeline(lifeline: BinaryIO, name: str) -> None:
    """Exit as soon as the parent's process is gone: the pipe's only writer is there, so its
    end of file means that process ended (or shut this child down), however it ended."""
    def wait() -> None:
        try:
            while lifeline.read(4096):
                pass
        except OSError:
            pass
        os._exit(0)
    threading.Thread(target=wait, name=name, daemon=True).start()


def close_quietly(pipe: Any) -> None:
    try:
        pipe.close()
    except OSError:
        pass


def describe_exit(code: Optional[int]) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
