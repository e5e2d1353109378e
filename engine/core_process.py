"""The engine core in a process of its own: ``python -m tokenrelay.engine.core_process FD``.

Started by engine/core_client.py (engine/lifeline.py: the spec on stdin, which stays open as
the lifeline; SIGINT/SIGTERM ignored). It loads the model, says READY, then runs vLLM v1's
busy loop: take every command waiting on the socket, run one step if there is work, send
its outputs, repeat. It never waits for the front end: the outputs of step N are on their
way while step N+1 runs (and, with ``async_scheduling``, while step N+2 is scheduled). When
there is no work it blocks on the socket, waking every ``ALIVE_EVERY_S`` to say it lives; during
a step longer than that, a thread of its own says it (``_Loop.beat``).

It ends when the front end says STOP, when the socket or the lifeline closes (the front
end's process is gone: a worker SIGKILLed leaves no process holding the GPU), or when a step
raises: then it sends FAILED (the message and the requests the exception names) and exits 1,
since a failed step can leave the device unusable (a CUDA error poisons the context).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, NoReturn

from tokenrelay.engine import core_wire as wire
from tokenrelay.engine.config import EngineConfig
from tokenrelay.engine.lifeline import child_start, watch_lifeline
from tokenrelay.heap import serve_heap


@dataclass(frozen=True)
class CoreSpec:
    """What the core's process needs: the config, and its share of the CPU threads."""

    config: EngineConfig
    threads: int = 0


class _Loop:
    """The busy loop around one EngineCore."""

    def __init__(self, core: Any, conn: Connection, sending: threading.Lock) -> None:
        self.core = core
        self.conn = conn
        self.adds = 0
        self.last_sent = 0.0
        self.last_stats = 0.0
        self.sending = sending              # the loop's sends, the beat's and FAILED's

    def apply(self, commands: list[tuple]) -> None:
        """Adds, aborts and finishes in the order the front end made them. A request the
        core refuses (a grammar known to fail) ends alone, with an error output."""
        errors = []
        for cmd in commands:
            kind = cmd[0]
            if kind == wire.ADD:
                self.adds += 1
                req = cmd[1]
                try:
                    self.core.add(req)
                except Exception as exc:     # the producer's problem: this request alone
                    from tokenrelay.engine.core import error_output
                    errors.append(error_output(req.request_id, exc,
                                               len(req.prompt_token_ids)))
            elif kind == wire.ABORT:
                self.core.abort(cmd[1])
            elif kind == wire.FINISH:
                self.core.finish_choice(cmd[1], cmd[2], cmd[3])
        if errors:
            self.send(errors)

    def send(self, outs: list) -> None:
        now = time.monotonic()
        stats = None
        if now - self.last_stats >= wire.STATS_EVERY_S:
            stats, self.last_stats = self.core.stats(), now
        status = wire.Status(self.core.free_capacity(), self.adds, self.core.has_unfinished(),
                             stats)
        self._send(wire.dumps((wire.OUTPUTS, wire.pack_outputs(outs), status)))

    def _send(self, frame: bytes) -> None:
        with self.sending:
            self.conn.send_bytes(frame)
            self.last_sent = time.monotonic()

    def beat(self) -> None:
        """The beat thread: while the process runs, the front end hears from it at least
        every ``ALIVE_EVERY_S``, also during a step longer than its deadline (a first compile
        of a new shape, a long prefill on a loaded host: a healthy core was once killed as
        hung). A stopped (SIGSTOP) or dead process stops beating, so the deadline still
        catches it; a step that hangs while the process runs is not caught by it."""
        try:
            while True:
                time.sleep(wire.ALIVE_EVERY_S / 2)
                if time.monotonic() - self.last_sent >= wire.ALIVE_EVERY_S:
                    self._send(wire.dumps((wire.ALIVE,)))
        except OSError:
            return                      # the front end is gone: the main thread exits

    def receive(self, timeout: float) -> bool:
        """Apply every command waiting (waiting up to ``timeout`` for the first); False when
        the front end said STOP."""
        conn = self.conn
        while conn.poll(timeout):
            timeout = 0.0
            msg = wire.loads(conn.recv_bytes())
            if msg[0] == wire.STOP:
                return False
            self.apply(msg[1])
        return True

    def run(self) -> None:
        core = self.core
        while True:
            busy = core.has_unfinished()
            if not self.receive(0.0 if busy else wire.ALIVE_EVERY_S):
                return
            if core.has_unfinished():
                outs = core.step()
                if outs or time.monotonic() - self.last_sent >= wire.ALIVE_EVERY_S:
                    self.send(outs)
            elif time.monotonic() - self.last_sent >= wire.ALIVE_EVERY_S or busy:
                self.send([])           # alive; or the last step's status (now idle)


def core_main(spec: CoreSpec, lifeline: Any, fd: int) -> NoReturn:
    """The core's life, from its spec to STOP or the end of the front end's process."""
    watch_lifeline(lifeline, "core-lifeline")
    conn = Connection(socket.socket(fileno=fd).detach())
    sending = threading.Lock()
    step_error = False
    try:
        import torch
        if spec.threads > 0:
            torch.set_num_threads(spec.threads)
        from tokenrelay.engine.core import EngineCore
        from tokenrelay.engine.loader import load_tokenizer
        config = spec.config
        core = EngineCore(config, tokenizer=load_tokenizer(config.model))
        bm = core.block_manager
        # As the worker does (tokenrelay/heap.py), before READY: its full collection can take
        # a second, and the front end's deadline starts at READY. It ends by os._exit.
        serve_heap()
        conn.send_bytes(wire.dumps((wire.READY, wire.CoreInfo(
            core.config, core.vocab_size, bm.num_blocks, bm.block_size, os.getpid(),
            core.free_capacity(), core.stats()))))
        step_error = True
        loop = _Loop(core, conn, sending)
        threading.Thread(target=loop.beat, name="core-beat", daemon=True).start()
        loop.run()
        core.shutdown()
        os._exit(0)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        os._exit(0)                     # the front end is gone
    except BaseException as exc:        # one message to the front end, the details on stderr
        ids = list(getattr(exc, "request_ids", None) or ())
        message = f"{type(exc).__name__}: {exc}"
        if not step_error:
            message = f"the engine core failed to start: {message}"
        print(f"tokenrelay engine core (pid {os.getpid()}) failed: {message}",
              file=sys.stderr, flush=True)
        traceback.print_exc(file=sys.stderr)
        try:
            with sending:               # not inside a beat's frame
                conn.send_bytes(wire.dumps((wire.FAILED, message, ids)))
        except OSError:
            pass
        sys.stderr.flush()
        os._exit(1)


def main() -> None:
    spec, lifeline = child_start()
    core_main(spec, lifeline, int(sys.argv[1]))


if __name__ == "__main__":
    main()
