"""Jobs as the producer sees them: deltas while streaming, one Result at the end.

``JobState`` folds a job's result-stream entries into text and a final Result. It holds the last
entry id seen, so any reader (sync, async, one job or a thousand multiplexed on one XREAD) resumes
from exactly there after a dropped connection, and the highest token ``seq`` seen, so a job that a
second worker resumed after a crash never repeats text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

import msgpack
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from producer_sdk.errors import LOST, JobFailed
from producer_sdk.protocol import (DoneEvent, ErrorEvent, ProtocolError, Timings, Usage,
                                   describe_validation_error)


@dataclass(frozen=True, slots=True)
class Delta:
    """New output of one engine step: ``text`` to append, its ``token_ids`` (and logprobs)."""

    text: str
    token_ids: list[int]
    logprobs: Optional[list[dict[int, float]]] = None
    index: int = 0
    seq: int = 0


class Result(BaseModel):
    """A finished job. ``finish_reason`` is stop, length or cancelled."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    text: str
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: str
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    metadata: dict[str, Any] = Field(default_factory=dict)
    logprobs: Optional[list[dict[int, float]]] = None
    stop_reason: Optional[Union[str, int]] = None
    attempts: int = 0


class JobState:
    """Everything read so far from one job's result stream (sans-IO, shared by sync and async)."""

    __slots__ = ("job_id", "key", "last_id", "max_seq", "parts", "token_ids", "logprobs",
                 "attempts", "seed", "terminal", "failure")

    def __init__(self, job_id: str, key: str) -> None:
        self.job_id = job_id
        self.key = key
        self.last_id: bytes = b"0-0"
        self.max_seq = -1
        self.parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: Optional[list[dict[int, float]]] = None
        self.attempts = 0
        self.seed: Optional[int] = None
        self.terminal: Optional[Union[DoneEvent, ErrorEvent]] = None
        self.failure: Optional[JobFailed] = None  # ended without a terminal event (see fail())

    @property
    def finished(self) -> bool:
        return self.terminal is not None or self.failure is not None

    def feed(self, entries: list[tuple[Any, dict]]) -> list[Delta]:
        """Apply result-stream entries in order; return the new deltas (duplicates skipped)."""
        deltas: list[Delta] = []
        for entry_id, fields in entries:
            self.last_id = entry_id if isinstance(entry_id, bytes) else str(entry_id).encode()
            if self.terminal is not None:
                continue  # nothing after a terminal event counts (a late, fenced-out writer)
            raw = fields.get(b"data", fields.get("data")) if fields else None
            if raw is None:
                continue
            d = self._apply(_unpack(raw, self.job_id))
            if d is not None:
                deltas.append(d)
        return deltas

    def _apply(self, ev: dict) -> Optional[Delta]:
        kind = ev.get("type")
        if kind == "token":
            return self._token(ev)
        if kind == "started":
            self.attempts = max(self.attempts + 1, int(ev.get("attempt", 1) or 1))
            self.seed = ev.get("seed", self.seed)
            return None
        if kind in ("done", "error"):
            return self._finish(ev)
        return None  # unknown event types are additive protocol changes: ignore them

    def _token(self, ev: dict) -> Optional[Delta]:
        try:
            seq = int(ev["seq"])
            text = ev["text"]
            ids = list(ev["token_ids"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError(f"job {self.job_id}: malformed token event {ev!r:.120}",
                                job_id=self.job_id) from None
        if seq <= self.max_seq:
            return None  # already seen: a resumed job re-emitting, or a replayed entry
        self.max_seq = seq
        self.parts.append(text)
        self.token_ids.extend(ids)
        lp = ev.get("logprobs")
        if lp is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(lp)
        return Delta(text, ids, lp, int(ev.get("index", 0)), seq)

    def _finish(self, ev: dict) -> Optional[Delta]:
        model = DoneEvent if ev["type"] == "done" else ErrorEvent
        try:
            self.terminal = model.model_validate(ev)
        except ValidationError as exc:
            raise ProtocolError(f"job {self.job_id}: malformed {ev['type']} event: "
                                f"{describe_validation_error(exc)}", job_id=self.job_id) from None
        t = self.terminal
        if isinstance(t, DoneEvent) and t.text and self.max_seq < 0:
            # stream=False jobs deliver the whole output with done: surface it as one delta.
            return Delta(t.text, list(t.token_ids or []), None, 0, 0)
        return None

    def fail(self, code: str, message: str) -> None:
        """End the job on the producer side (e.g. its results expired): result() raises this."""
        if self.terminal is None:
            self.failure = JobFailed(self.job_id, code, message)

    def mark_lost(self) -> None:
        self.fail(LOST, "the job is known but neither queued nor has a result stream: its results "
                  "expired before they were read; resubmit it under a new job id")

    def result(self) -> Result:
        """The final Result; raises JobFailed for error events and lost jobs."""
        t = self.terminal
        if t is None and self.failure is not None:
            raise self.failure
        if t is None:
            raise RuntimeError(f"job {self.job_id} has not finished yet")
        if isinstance(t, ErrorEvent):
            raise JobFailed(self.job_id, t.code, t.message)
        text = t.text if t.text is not None else "".join(self.parts)
        ids = list(t.token_ids) if t.token_ids is not None else self.token_ids
        logprobs = self.logprobs if self.logprobs is not None else getattr(t, "logprobs", None)
        return Result(job_id=self.job_id, text=text, token_ids=ids, finish_reason=t.finish_reason,
                      usage=t.usage, timings=t.timings, metadata=t.metadata, logprobs=logprobs,
                      stop_reason=t.stop_reason, attempts=self.attempts)


def _unpack(raw: Any, job_id: str) -> dict:
    try:
        ev = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"job {job_id}: result event is not msgpack ({exc})",
                            job_id=job_id) from None
    if not isinstance(ev, dict):
        raise ProtocolError(f"job {job_id}: result event is not a map: {ev!r:.80}", job_id=job_id)
    return ev


class Deadline:
    """A timeout turned into an absolute monotonic deadline (None = wait forever)."""

    __slots__ = ("end",)

    def __init__(self, timeout: Optional[float]) -> None:
        self.end = None if timeout is None else time.monotonic() + max(0.0, timeout)

    def block_ms(self, cap_ms: int) -> int:
        """Milliseconds for the next XREAD BLOCK (at least 1: BLOCK 0 means forever)."""
        if self.end is None:
            return cap_ms
        return max(1, min(cap_ms, int((self.end - time.monotonic()) * 1000)))

    @property
    def expired(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end


class JobHandle:
    """What the sync and async job handles share: ids and the state read so far (no I/O)."""

    __slots__ = ("client", "id", "_state", "reattached")

    def __init__(self, client: Any, job_id: str, *, reattached: bool = False) -> None:
        self.client = client
        self.id = job_id
        self._state: Optional[JobState] = None  # created on first read: submit_many stays cheap
        self.reattached = reattached

    @property
    def state(self) -> JobState:
        if self._state is None:
            self._state = JobState(self.id, self.client.keys.results(self.id))
        return self._state

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, finished={self.state.finished})"

    @property
    def done(self) -> bool:
        """True once a terminal event was read (does not poll Redis)."""
        return self.state.finished


class Job(JobHandle):
    """A handle on one submitted job (sync). Cheap: holds ids and what was read so far."""

    __slots__ = ()

    def stream(self, timeout: Optional[float] = None) -> Iterator[Delta]:
        """Yield deltas as they arrive, from where this handle last read; JobFailed on error."""
        deadline = Deadline(timeout)
        while not self.state.finished:
            if deadline.expired:
                raise TimeoutError(f"job {self.id}: no terminal event within {timeout}s")
            for delta in self.client._pump_one(self.state, deadline):
                yield delta
        if self.state.failure is not None or isinstance(self.state.terminal, ErrorEvent):
            self.state.result()  # raises JobFailed

    def result(self, timeout: Optional[float] = None) -> Result:
        """Wait for the job to finish. Raises JobFailed, or TimeoutError after ``timeout`` s."""
        deadline = Deadline(timeout)
        while not self.state.finished:
            if deadline.expired:
                raise TimeoutError(f"job {self.id}: not finished within {timeout}s "
                                   f"(it keeps running; call job.cancel() to stop it)")
            self.client._pump_one(self.state, deadline)
        return self.state.result()

    def cancel(self) -> None:
        """Ask the worker to stop (a queued job never starts). The job ends with done/cancelled."""
        self.client.cancel(self.id)
