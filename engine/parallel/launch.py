"""Rank 0's side of a tensor-parallel engine: start ranks 1..N-1, watch them, stop them.

Start: a TCPStore on a port the OS picks (so several engines and workers on one host never
collide), then one fresh interpreter per rank, ``python -m tokenrelay.engine.parallel.rank`` (spawned: no
fork of a process holding threads and a model, and no re-import of the caller's main module),
whose stdin carries its pickled :class:`RankSpec` and then stays open as its *lifeline*: only
this process holds the write end. Rank 0 waits for every rank to check in, with the timeout,
and gives up at once on a rank that exits instead.

No orphans, on any exit path: a rank exits when its stdin reads end-of-file (this process is
gone, however it died), when its connection to rank 0 drops, or when told to stop;
``shutdown`` (also run when the engine is garbage collected, and at interpreter exit) closes
the lifelines, then kills what is left. Ranks stay in this process's process
group, so a ``kill`` of the group reaches them too.

Failure: one watcher thread per rank waits for its exit. A rank that dies, or a step that fails
(a collective error or timeout), marks the group failed with one message naming the rank and
how it ended; ``on_failure`` (the worker's: log it and exit) is called once with it.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import subprocess
import threading
import time
from typing import Callable, Optional

import torch

from tokenrelay.engine.config import EngineConfig
from tokenrelay.engine.errors import TensorParallelError
from tokenrelay.engine.lifeline import close_quietly, describe_exit, spawn
from tokenrelay.engine.parallel import step as step_wire
from tokenrelay.engine.parallel.group import ParallelGroup, open_store, rank_devices, start_timeout
from tokenrelay.engine.parallel.rank_spec import RankSpec, hello_key
from tokenrelay.engine.step_inputs import StepInputs

log = logging.getLogger("tokenrelay.engine.parallel")

# How long a rank whose connection just dropped gets to finish exiting before its failure is
# described (so the message says how it ended).
_DEATH_GRACE_S = 2.0
_STOP_JOIN_S = 5.0
_FAILED_JOIN_S = 1.0


class RankSet:
    """Ranks 1..N-1 of one engine, seen from rank 0, and rank 0's :class:`ParallelGroup`."""

    def __init__(self, config: EngineConfig,
                 on_failure: Optional[Callable[[str], None]] = None) -> None:
        size = config.tensor_parallel_size
        self.size = size
        self.on_failure = on_failure
        self.error: Optional[str] = None
        self._lock = threading.Lock()
        self._failure_lock = threading.Lock()
        self._stopped = False
        # Per-rank threads split this process's budget (OMP_NUM_THREADS, or the cores).
        threads = max(1, torch.get_num_threads() // size)
        torch.set_num_threads(threads)
        devices = rank_devices(config.device, size)
        if devices[0].startswith("cuda"):
            torch.cuda.set_device(devices[0])       # NCCL's device for rank 0
        join_s = start_timeout(config.tensor_parallel_timeout)
        store, rendezvous = open_store(None, size, join_s)
        self.procs: list[subprocess.Popen] = []
        atexit.register(self.shutdown)
        try:
            for rank in range(1, size):
                spec = RankSpec(dataclasses.replace(config, device=devices[rank]), rank,
                                rendezvous, threads)
                self.procs.append(_spawn(spec))
            self._await_hellos(store, join_s)
            self.group = ParallelGroup(store, 0, size, torch.device(devices[0]),
                                       config.tensor_parallel_timeout)
        except BaseException:
            self.shutdown()
            raise

    # -- start ------------------------------------------------------------------------------
    def ready(self) -> None:
        """Every rank loaded its share: from now on a rank that dies fails the engine at once
        (``on_failure``), even while it sits idle between steps."""
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch, args=(proc,), daemon=True,
                             name=f"tp-rank{rank}-watch").start()

    def abort_start(self, exc: BaseException) -> BaseException:
        """Start-up failed with ``exc``: stop the ranks. The error to raise: a
        TensorParallelError naming the rank that died when ``exc`` is the collective that
        noticed it, else ``exc`` itself (say, a checkpoint this engine cannot load)."""
        dead = self._await_death() if isinstance(exc, RuntimeError) else []
        self.shutdown()
        if dead:
            return TensorParallelError(f"tensor-parallel {', '.join(dead)} while starting; "
                                       f"its error is above")
        return exc

    def _await_hellos(self, store, timeout_s: float) -> None:
        """Every rank checked in to the store; a rank that exits first fails the start at once
        (its own error is on this process's stderr), one that never comes after the timeout."""
        deadline = time.monotonic() + timeout_s
        for rank, proc in enumerate(self.procs, start=1):
            while not store.check([hello_key(rank)]):
                if proc.poll() is not None:
                    raise TensorParallelError(
                        f"tensor-parallel rank {rank} (pid {proc.pid}) "
                        f"{describe_exit(proc.returncode)} while starting; its error is above")
                if time.monotonic() > deadline:
                    raise TensorParallelError(
                        f"tensor-parallel rank {rank} (pid {proc.pid}) did not join within "
                        f"{timeout_s:g} s")
                time.sleep(0.02)

    # -- steps ------------------------------------------------------------------------------
    def send(self, step: StepInputs) -> None:
        """The step to every other rank; TensorParallelError once the group has failed."""
        if self.error is not None:
            raise TensorParallelError(self.error)
        if self._stopped:
            raise TensorParallelError("this tensor-parallel engine was shut down")
        step_wire.send_step(self.group, step)

    # -- failure ----------------------------------------------------------------------------
    def dead(self) -> list[str]:
        """"rank R (pid P) <how it ended>" for every rank that is no longer running."""
        return [f"rank {r} (pid {p.pid}) {describe_exit(p.returncode)}"
                for r, p in enumerate(self.procs, start=1) if p.poll() is not None]

    def _await_death(self) -> list[str]:
        """The dead ranks, after giving a rank whose connection just dropped a moment to
        finish exiting (so the message can say how it ended)."""
        deadline = time.monotonic() + _DEATH_GRACE_S
        while not self.dead() and time.monotonic() < deadline and not self._stopped:
            time.sleep(0.02)
        return self.dead()

    def failed(self, exc: BaseException) -> TensorParallelError:
        """A step failed with ``exc``: record why (calling ``on_failure``), stop the ranks,
        and return the error to raise. A dead rank is named; otherwise the collective's own
        error is."""
        dead = self._await_death()
        if dead:
            message = f"tensor-parallel {', '.join(dead)}"
        else:
            message = (f"a tensor-parallel step failed on rank 0, the ranks are out of step "
                       f"({type(exc).__name__}: {exc})")
        self._fail(message)
        self.shutdown()
        return TensorParallelError(self.error or message)

    def _fail(self, message: str) -> None:
        """Record the first failure and report it once: through ``on_failure`` (which may end
        the process; a second failing thread waits here meanwhile, so only one path acts),
        else as one log line."""
        with self._failure_lock:
            if self.error is not None:
                return
            self.error = message
            # The ranks stop before ``on_failure`` may end this process: a frozen rank
            # (SIGSTOP, a hung host) never reads the end of its lifeline, and only the kill in
            # shutdown() ends it (issue #42: it outlived its worker).
            self.shutdown()
            if self.on_failure is not None:
                self.on_failure(message)
            else:
                log.error("%s; the engine cannot continue", message)

    def _watch(self, proc: subprocess.Popen) -> None:
        proc.wait()
        if not self._stopped:
            self._fail(f"tensor-parallel {', '.join(self.dead())}")

    # -- stop -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every rank (idempotent): close their lifelines (a rank exits on its end of
        file, even in the middle of a wait for a step), then kill whatever has not exited."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        for proc in self.procs:         # end of file on the lifeline: the rank exits
            close_quietly(proc.stdin)
        # A failed group's ranks may hang in a collective (or be stopped): no long wait.
        deadline = time.monotonic() + (_STOP_JOIN_S if self.error is None else _FAILED_JOIN_S)
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()             # SIGTERM is ignored by ranks: see rank.py
                proc.wait()
        atexit.unregister(self.shutdown)
        self.group = None


def _spawn(spec: RankSpec) -> subprocess.Popen:
    """``python -m tokenrelay.engine.parallel.rank R``, ``spec`` on its lifeline."""
    return spawn("tokenrelay.engine.parallel.rank", [str(spec.rank)], spec)


def launch_ranks(config: EngineConfig,
                 on_failure: Optional[Callable[[str], None]] = None) -> RankSet:
    """Start ranks 1..N-1 of ``config``'s engine and join them as rank 0."""
    return RankSet(config, on_failure)
