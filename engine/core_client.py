"""EngineCoreClient: the step API (``LLMEngine``'s) with the engine core in a process of its
own (engine/core_process.py), as vLLM v1 runs it beside a GPU.

This process keeps the front end: request checks and tokenization (engine/request_checks.py),
the chat template, and the output processor (ids to text deltas, stop strings, finish
reasons: engine/output_processor.py). The core's process schedules, runs and samples in a
busy loop and never waits for this one, so the Python this process runs (the worker's event
building, its Redis writes) no longer takes the GIL from the step.

``step()`` sends the commands made since the last call (adds, aborts, the stop strings the
previous outputs hit) as one message, then returns the deltas of every output message that
arrived, merged to one delta per choice; it waits at most ``wait_s`` for the first.

Aborts, the bound across the boundary: ``abort_request`` forgets the request here at once, so
no delta of it comes back after the call, even from outputs the core sent before it heard
(it runs ahead of this process and its outputs may be queued on the socket: they are dropped
here). The abort leaves with the next ``step()``'s commands and the core applies every command
before its next step, so it frees the request (its slot, its blocks) after at most the step
it had in flight: within two steps of the call, counting the ``step()`` that sends it.
tests/engine/test_core_process.py holds it to that.

Failure: the core's process ending (a SIGKILL, a crash) or going silent for ``timeout_s``
while it has work (stopped by SIGSTOP, or wedged whole: a thread of the core's says it lives
during a long step, so a slow step is never taken for a dead core) fails the engine: ``on_failure(message)`` is called once
(the worker's exits at once, like a tensor-parallel rank's death: the jobs' leases lapse and
other workers resume them exactly once), the core is killed, and every later call raises
``EngineCoreError``. A step the core itself failed raises ``EngineCoreError`` naming the
requests the exception named (the worker hands those back counting a delivery).
"""

from __future__ import annotations

import atexit
import socket
import subprocess
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence as Seq, Union

from tokenrelay.engine import core_wire as wire
from tokenrelay.engine.config import EngineConfig
from tokenrelay.engine.core_process import CoreSpec
from tokenrelay.engine.errors import InvalidRequestError
from tokenrelay.engine.lifeline import close_quietly, describe_exit, spawn
from tokenrelay.engine.block_manager import PoolShape
from tokenrelay.engine.output_processor import OutputProcessor
from tokenrelay.engine.outputs import CoreOutput, RequestDelta, ResumeState, merge_deltas
from tokenrelay.engine.prompts import PromptType, render_chat, tool_call_format
from tokenrelay.engine.request_checks import RequestChecks
from tokenrelay.engine.sampling_params import SamplingParams
from tokenrelay.protocol.tools import NO_TOOLS
from multiprocessing.connection import Connection

_STOP_JOIN_S = 10.0
_DEATH_GRACE_S = 2.0


class EngineCoreError(RuntimeError):
    """The engine core's process failed: it died, went silent past the deadline, or a step
    raised there. ``request_ids``: the requests the failing step named, if any."""

    def __init__(self, message: str, request_ids: Seq[str] = ()) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids)


class EngineCoreClient:
    """The front end of an engine whose core runs in a child process (module docstring)."""

    def __init__(self, config: EngineConfig, *, tokenizer: Optional[Any] = None,
                 on_failure: Optional[Callable[[str], None]] = None,
                 timeout_s: float = 30.0, start_timeout_s: float = 600.0,
                 wait_s: float = 0.05, threads: int = 0) -> None:
        config.resolve()        # a missing or unsupported checkpoint says so here, at once
        if tokenizer is None:
            from tokenrelay.engine.loader import load_tokenizer
            tokenizer = load_tokenizer(config.model)
        self.tokenizer = tokenizer
        self.on_failure = on_failure
        self.timeout_s = timeout_s
        self.wait_s = wait_s
        self.error: Optional[str] = None
        self._stopped = False
        self._lock = threading.Lock()
        ours, theirs = socket.socketpair()
        self.conn = Connection(ours.detach())
        try:
            self.proc = spawn("tokenrelay.engine.core_process", [str(theirs.fileno())],
                              CoreSpec(config, threads), pass_fds=[theirs.fileno()])
        finally:
            theirs.close()
        atexit.register(self.shutdown)
        info = self._await_ready(start_timeout_s)
        self.config = info.config
        self.core_pid = info.pid
        self.vocab_size = info.vocab_size
        self.max_model_len: int = info.config.max_model_len
        self.checks = RequestChecks(config=info.config, tokenizer=tokenizer,
                                    vocab_size=info.vocab_size,
                                    pool=PoolShape(info.num_blocks, info.block_size))
        self.outputs = OutputProcessor(tokenizer)
        self._stats = info.stats
        self._commands: list[tuple] = []
        self._adds_sent = 0
        self._status = wire.Status(info.free_capacity, 0, False)
        self._last_heard = time.monotonic()
        self._tool_format: Optional[str] = None
        threading.Thread(target=self._watch, name="core-watch", daemon=True).start()

    # -- start and failure -----------------------------------------------------------------
    def _await_ready(self, timeout_s: float) -> wire.CoreInfo:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.conn.poll(0.1):
                try:
                    msg = wire.loads(self.conn.recv_bytes())
                except (EOFError, OSError):
                    break
                if msg[0] == wire.READY:
                    return msg[1]
                if msg[0] == wire.FAILED:
                    self.shutdown()
                    raise EngineCoreError(msg[1])
            if self.proc.poll() is not None:
                break
        self.shutdown()
        code = self.proc.poll()
        how = (f"did not start within {timeout_s:g} s" if code is None
               else f"{describe_exit(code)} while starting")
        raise EngineCoreError(f"the engine core (pid {self.proc.pid}) {how}")

    def _watch(self) -> None:
        """The core's process ended: unless we stopped it, the engine failed."""
        self.proc.wait()
        if not self._stopped:
            self._fail(f"the engine core (pid {self.proc.pid}) "
                       f"{describe_exit(self.proc.returncode)}")

    def _fail(self, message: str) -> None:
        """Record the first failure, stop the core, report it once."""
        with self._lock:
            if self.error is not None:
                return
            self.error = message
        self.shutdown()
        if self.on_failure is not None:
            self.on_failure(message)

    def _gone(self, exc: BaseException) -> str:
        """Why the connection broke: how the core's process ended, once it has (a moment's
        grace, so the message can say), else the socket's error."""
        try:
            code = self.proc.wait(_DEATH_GRACE_S)
        except subprocess.TimeoutExpired:
            return (f"the engine core (pid {self.proc.pid}) connection broke "
                    f"({type(exc).__name__}: {exc})")
        return f"the engine core (pid {self.proc.pid}) {describe_exit(code)}"

    def _check(self) -> None:
        if self.error is not None:
            raise EngineCoreError(self.error)

    # -- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType,
                    params: Union[SamplingParams, Mapping[str, Any], None] = None,
                    priority: int = 0,
                    resume: Union[ResumeState, Seq[ResumeState], None] = None,
                    owner: Optional[str] = None) -> None:
        """As ``LLMEngine.add_request``; checked here, queued for the core. A grammar the core
        refuses ends the request with an error delta instead of raising here."""
        self._check()
        if self.outputs.has(request_id):
            raise InvalidRequestError(f"request_id: {request_id!r} is already in use")
        req, _ = self.checks.build(request_id, prompt, params, priority, resume)
        req.owner = owner       # the job's producer: its grammar compile's turn (compile_queue)
        self.outputs.add(request_id, req.prompt_token_ids, req.params, req.resume)
        self._commands.append((wire.ADD, req))

    def abort_request(self, request_id: str) -> bool:
        """Forget the request here at once (no delta follows) and abort it in the core with
        the next step's commands."""
        known = self.outputs.abort(request_id)
        if not known:
            return False
        queued = [i for i, c in enumerate(self._commands)
                  if c[0] == wire.ADD and c[1].request_id == request_id]
        if queued:                  # the core never saw it: nothing to abort there
            del self._commands[queued[0]]
        else:
            self._commands.append((wire.ABORT, request_id))
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.outputs.live)

    def num_unfinished_requests(self) -> int:
        return len(self.outputs.live)

    def free_capacity(self) -> int:
        """The core's last reported capacity, less the adds it had not applied then."""
        in_flight = self._adds_sent - self._status.adds_applied
        queued = sum(1 for c in self._commands if c[0] == wire.ADD)
        return max(0, self._status.free_capacity - in_flight - queued)

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Send the commands made since the last call; return the deltas of every core step
        that arrived, one per choice (waiting up to ``wait_s`` for the first)."""
        self._check()
        self._flush()
        deltas: list[RequestDelta] = []
        got = self._receive(deltas, self.wait_s if self.outputs.live else 0.0)
        if not got and self.outputs.live and \
                time.monotonic() - self._last_heard > self.timeout_s:
            self._fail(f"the engine core (pid {self.proc.pid}) sent nothing for "
                       f"{self.timeout_s:g} s with work to do (stopped or hung); killed")
            self._check()
        return merge_deltas(deltas)

    def _flush(self) -> None:
        if not self._commands:
            return
        commands, self._commands = self._commands, []
        self._adds_sent += sum(1 for c in commands if c[0] == wire.ADD)
        self._send((wire.COMMANDS, commands))

    def _send(self, message: tuple) -> None:
        try:
            self.conn.send_bytes(wire.dumps(message))
        except OSError as exc:
            self._fail(self._gone(exc))
            self._check()

    def _receive(self, deltas: list[RequestDelta], wait: float) -> bool:
        """Process every message waiting (up to ``wait`` for the first); True if any came."""
        got = False
        steps: list[list[CoreOutput]] = []
        try:
            while self.conn.poll(wait):
                wait = 0.0
                msg = wire.loads(self.conn.recv_bytes())
                got = True
                self._last_heard = time.monotonic()
                if msg[0] == wire.FAILED:
                    self._stopped = True        # it exits by itself; not a death to report
                    raise EngineCoreError(f"engine core step failed: {msg[1]}", msg[2])
                if msg[0] == wire.ALIVE:
                    continue                    # a long step: the core's process runs
                self._on_status(msg[2])
                outs = wire.unpack_outputs(msg[1])
                if outs:
                    steps.append(outs)
        except (EOFError, OSError) as exc:
            self._fail(self._gone(exc))
            self._check()
        if steps:
            self._on_outputs(steps, deltas)
        return got

    def _on_status(self, status: wire.Status) -> None:
        self._status = status
        if status.stats is not None:
            self._stats = status.stats

    def _on_outputs(self, steps: list[list[CoreOutput]], deltas: list[RequestDelta]) -> None:
        """Every step that arrived, processed at once (``OutputProcessor.process_steps``)."""
        done = self.outputs.process_steps(steps)
        for request_id, index, stop in done.stops:
            self._commands.append((wire.FINISH, request_id, index, stop))
        deltas.extend(done.deltas)

    # -- the rest of the step API ------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """The core's statistics as of its last report (at most ``STATS_EVERY_S`` old)."""
        return dict(self._stats)

    def render_chat(self, messages: list[dict],
                    chat_template_kwargs: Optional[Mapping[str, Any]] = None,
                    tools: Optional[list[dict]] = None) -> str:
        return render_chat(self.tokenizer, messages, chat_template_kwargs, tools,
                           self.tool_call_format if tools else NO_TOOLS)

    @property
    def tool_call_format(self) -> str:
        if self._tool_format is None:
            self._tool_format = tool_call_format(self.tokenizer)
        return self._tool_format

    def shutdown(self) -> None:
        """Stop the core (idempotent): STOP, then the lifeline closes; a core that has not
        exited in time (or a failed one, which may be stopped) is killed."""
        with self._lock:
            if self._stopped and self.proc.poll() is not None:
                return
            self._stopped = True
        if self.error is None:
            try:
                self.conn.send_bytes(wire.dumps((wire.STOP,)))
            except OSError:
                pass
        close_quietly(self.proc.stdin)
        try:
            self.proc.wait(_STOP_JOIN_S if self.error is None else 0.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()            # SIGTERM is ignored by the core: engine/lifeline.py
            self.proc.wait()
        close_quietly(self.conn)
        atexit.unregister(self.shutdown)
