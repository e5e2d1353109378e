"""The jobs this worker holds: each one's entry, request, ownership and the events it owes.

No Redis I/O: the loop turns engine deltas into events here and the outbox ships ``pending``
once per step. Keeping the emitted tokens and text lets the
worker re-add a job to the engine with a resume state after an engine failure, and count
partial output in ``usage`` when a job is cancelled.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterator, Optional

import msgpack

from tokenrelay.protocol.events import (DoneChoice, DoneEvent, ErrorEvent, LogprobTokens, StartedEvent,
                             Timings, Usage, encode_event)
from tokenrelay.protocol.errors import ErrorCode, FinishReason
from tokenrelay.protocol.wire import JobRequest
from tokenrelay.worker.entries import Entry
from tokenrelay.worker.token_text import TokenTexts


def encode_token_event(seq: int, choice: int, position: int, text: str, token_ids: list[int],
                       logprobs: Optional[list[dict[int, float]]], ts: float,
                       finish_reason: Optional[str] = None, stop_reason: Any = None,
                       cumulative_logprob: Optional[float] = None,
                       logprob_tokens: Optional[LogprobTokens] = None) -> bytes:
    """``encode_event(TokenEvent(...))`` without pydantic: token events are the hot path (one per
    running choice per step) and this is 4x cheaper. The same bytes, keys in the model's order
    (tests/worker/test_jobs.py holds them equal). ``finish_reason`` (with ``stop_reason`` and
    ``cumulative_logprob``) is given on a choice's last event only; ``logprob_tokens`` (text and
    bytes of the ids ``logprobs`` names) only with logprobs."""
    ev: dict[str, Any] = {"type": "token", "seq": seq, "choice": choice, "position": position,
                          "text": text, "token_ids": [int(t) for t in token_ids]}
    if logprobs is not None:
        ev["logprobs"] = [{int(k): float(v) for k, v in d.items()} for d in logprobs]
        if logprob_tokens is not None:
            ev["logprob_tokens"] = logprob_tokens
    if finish_reason is not None:
        ev["finish_reason"] = finish_reason
        if stop_reason is not None:
            ev["stop_reason"] = stop_reason
        if cumulative_logprob is not None:
            ev["cumulative_logprob"] = float(cumulative_logprob)
    ev["ts"] = ts
    return _token_packer().pack(ev)


_PACKERS = threading.local()


def _token_packer() -> msgpack.Packer:
    """One msgpack Packer per thread, made once: ``msgpack.packb`` builds a Packer per call,
    half the cost of packing a token event (issue #29). Per thread because token events are
    built by the writer's thread when the loop overlaps and by the loop's thread in series, and
    a Packer holds its buffer between calls. Same options as ``packb(use_bin_type=True)``."""
    packer = getattr(_PACKERS, "packer", None)
    if packer is None:
        packer = _PACKERS.packer = msgpack.Packer(use_bin_type=True)
    return packer


@dataclass
class Choice:
    """One choice's output so far, resumed tokens included (sample i of n, or a beam)."""

    ids: list[int] = field(default_factory=list)
    parts: list[str] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Any = None
    cumulative_logprob: Optional[float] = None
    completion_tokens: Optional[int] = None     # the engine's count at its end
    # stream=False jobs that asked for logprobs: kept for the done event
    logprobs: Optional[list[dict[int, float]]] = None
    logprob_tokens: Optional[LogprobTokens] = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def summary(self, index: int, full: bool) -> DoneChoice:
        """Its entry in the done event (with its output when the job does not stream)."""
        return DoneChoice(index=index, finish_reason=self.finish_reason or FinishReason.STOP.value,
                          stop_reason=self.stop_reason, completion_tokens=self.tokens,
                          cumulative_logprob=self.cumulative_logprob,
                          text=self.text if full else None,
                          token_ids=list(self.ids) if full else None,
                          logprobs=self.logprobs if full else None,
                          logprob_tokens=self.logprob_tokens if full else None)

    def keep_logprobs(self, logprobs: list[dict[int, float]], names: LogprobTokens) -> None:
        """Collect a non-streaming choice's logprobs for its done event."""
        if self.logprobs is None:
            self.logprobs, self.logprob_tokens = [], {}
        self.logprobs.extend({int(k): float(v) for k, v in d.items()} for d in logprobs)
        self.logprob_tokens.update(names)

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.ids)


@dataclass
class Job:
    entry: Entry
    request: JobRequest
    owner: str                           # "<worker_id>:<token>" written to Keys.owner
    worker_id: str
    seed: int = 0
    attempt: int = 1
    want_logprobs: bool = False
    token_texts: Optional[TokenTexts] = None   # set with want_logprobs: names their tokens
    next_seq: int = 0                    # seq of the next token event
    choices: list[Choice] = field(default_factory=lambda: [Choice()])   # by choice index
    several: bool = False                # n > 1 or beam search: done carries every choice
    resumed_tokens: int = 0
    prompt_tokens: int = 0
    admitted_at: float = field(default_factory=time.time)
    first_token_at: Optional[float] = None
    last_token_at: Optional[float] = None
    finished_at: Optional[float] = None
    # write state
    pending: list[bytes] = field(default_factory=list)  # encoded events not yet written
    batch_no: int = 0
    may_create: bool = True              # the stream may be created until the first write lands
    stream_len: int = 0                  # entries we know the result stream holds (checked)
    terminal: Optional[str] = None       # "done"/"error" once the terminal event is queued
    ttl_set_at: float = 0.0              # monotonic time the stream/owner TTLs were last set
    finish_reason: Optional[str] = None
    error_code: Optional[str] = None
    in_engine: bool = False
    parking: bool = False                # draining: hand the entry back once events are written
    params: Any = None                   # the validated SamplingParams (seed filled in)
    write_failures: int = 0

    @property
    def job_id(self) -> str:
        return self.request.job_id

    @property
    def enqueued_ms(self) -> int:
        return self.request.submitted_ms or self.entry.enqueued_ms

    @cached_property
    def owner_token(self) -> str:
        """The token of ``owner`` (set once, when the job is admitted)."""
        return self.owner.rsplit(":", 1)[-1]

    @property
    def batch_id(self) -> str:
        return f"{self.owner_token}.{self.batch_no}"

    @property
    def text(self) -> str:
        """Choice 0's text (all of an n == 1 job)."""
        return self.choices[0].text

    @property
    def tokens(self) -> int:
        """Output tokens of every choice so far."""
        return sum(len(c.ids) for c in self.choices)

    def shape(self, num_choices: int, several: bool) -> None:
        """Make room for every choice of the request (resumed ones are already there; a stream
        naming choices past ``num_choices`` was not written by a worker, they are dropped)."""
        self.choices.extend(Choice() for _ in range(num_choices - len(self.choices)))
        del self.choices[num_choices:]
        self.several = several

    def all_finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def log_fields(self) -> dict[str, Any]:
        """What every log line of this job carries; the producer's W3C traceparent too, so a
        request can be followed from the web backend's trace into the worker's log."""
        fields = {"job_id": self.job_id, "entry_id": self.entry.entry_id, "lane": self.entry.lane}
        if self.request.traceparent:
            fields["traceparent"] = self.request.traceparent
        return fields

    # ------------------------------------------------------------------ events
    def queue_started(self) -> None:
        self.pending.append(encode_event(StartedEvent(
            worker_id=self.worker_id, attempt=self.attempt, seed=self.seed,
            resumed_tokens=self.resumed_tokens)))

    def on_delta(self, delta: Any, ts: float) -> bool:
        """Record one engine delta of one choice; queue its token event (stream jobs) and, once
        every choice has finished, the done event. A delta of a choice already finished (a
        beam search rerun after a takeover re-delivers beams the stream holds) is dropped.
        Returns True when this delta carried the first token of this attempt."""
        index = delta.index
        c = self.choices[index] if 0 <= index < len(self.choices) else None
        if c is None or c.finish_reason is not None:
            return False
        if delta.cumulative_logprob is not None:
            c.cumulative_logprob = delta.cumulative_logprob
        reason = None
        if delta.finished:
            reason = c.finish_reason = delta.finish_reason or FinishReason.STOP.value
            c.stop_reason, c.completion_tokens = delta.stop_reason, delta.num_output_tokens
        over = reason is not None and self.all_finished()
        first = False
        if delta.new_token_ids or delta.new_text or (reason is not None and not over):
            if delta.new_token_ids or delta.new_text:
                if self.first_token_at is None:
                    self.first_token_at, first = ts, True
                self.last_token_at = ts
            lp = delta.logprobs if self.want_logprobs else None
            names = self.token_texts.for_logprobs(lp) if lp and self.token_texts else None
            if self.request.stream:
                self.pending.append(encode_token_event(
                    self.next_seq, index, len(c.ids), delta.new_text, delta.new_token_ids,
                    lp, ts, reason, c.stop_reason, c.cumulative_logprob, names))
                self.next_seq += 1
            elif lp is not None:
                c.keep_logprobs(lp, names or {})
            c.ids.extend(delta.new_token_ids)
            c.parts.append(delta.new_text)
        self.prompt_tokens = delta.num_prompt_tokens or self.prompt_tokens
        if over:
            self.finish()
        return first

    def finish(self, reason: Optional[str] = None) -> None:
        """Queue the done event: once every choice finished, or with ``reason`` (cancelled, or
        the length a taken-over job had already reached), which ends every choice that has not
        finished and is the job's finish reason."""
        for c in self.choices:
            if c.finish_reason is None:
                c.finish_reason = reason or FinishReason.STOP.value
        first = self.choices[0]
        self.finished_at = time.time()
        self.terminal = "done"
        self.finish_reason = reason or first.finish_reason
        full = not self.request.stream
        self.pending.append(encode_event(DoneEvent(
            finish_reason=self.finish_reason,
            stop_reason=first.stop_reason if self.finish_reason == first.finish_reason else None,
            usage=Usage(prompt_tokens=self.prompt_tokens,
                        completion_tokens=sum(c.tokens for c in self.choices)),
            timings=self.timings(), metadata=self.request.metadata,
            text=first.text if full else None, token_ids=list(first.ids) if full else None,
            logprobs=first.logprobs if full else None,
            logprob_tokens=first.logprob_tokens if full else None,
            choices=([c.summary(i, full) for i, c in enumerate(self.choices)]
                     if self.several else None))))

    def fail(self, code: str, message: str) -> None:
        self.finished_at = time.time()
        self.terminal, self.error_code = "error", code
        self.pending.append(encode_event(ErrorEvent(code=code, message=message,
                                                    metadata=self.request.metadata)))

    def timings(self) -> Timings:
        """All from the enqueue time (submitted_ms, else the entry id's timestamp)."""
        base = self.enqueued_ms / 1000.0
        if not base:
            return Timings()

        def ms(t: Optional[float]) -> Optional[float]:
            return None if t is None else round(max(0.0, (t - base) * 1000.0), 3)
        return Timings(queued_ms=ms(self.admitted_at), ttft_ms=ms(self.first_token_at),
                       total_ms=ms(self.finished_at))


class JobTable(dict):
    """job id -> Job for every job this worker holds, and the ways a held job ends early. Each
    takes it out of the engine first, so the engine never runs a job the worker gave up."""

    def __init__(self, engine: Any, metrics: Any, log: Any) -> None:
        super().__init__()
        self.engine = engine
        self.metrics = metrics
        self.log = log
        self._aborts: Optional[list[str]] = None    # while a step runs: aborts it waits for

    def _out_of_engine(self, job: Job) -> None:
        if job.in_engine:
            job.in_engine = False
            if self._aborts is not None:
                self._aborts.append(job.job_id)
            else:
                self.engine.abort_request(job.job_id)

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """While the loop's thread runs an engine step and the writer's flush ends jobs
        (cancel flags, lost ownership): those jobs leave the table's view of the engine at
        once (``in_engine`` is False, so the step's deltas for them are ignored), and the
        engine hears of it when the step is over. Why: an engine is not safe to call from two
        threads, and only the loop's thread calls it."""
        self._aborts = []
        try:
            yield
        finally:
            aborts, self._aborts = self._aborts, None
            for job_id in aborts:
                self.engine.abort_request(job_id)

    def fail(self, job: Job, code: ErrorCode, message: str) -> None:
        """End the job with an error event (written by the next flush)."""
        self._out_of_engine(job)
        job.fail(code.value, message)
        self.metrics.errors.labels(code.value).inc()
        self.log.info("failed", code=code.value, error=message, **job.log_fields())

    def cancel(self, job: Job, why: str) -> None:
        self._out_of_engine(job)
        job.finish(FinishReason.CANCELLED.value)
        self.metrics.finished.labels("cancelled").inc()
        self.log.info("cancelled", why=why, tokens=job.tokens, **job.log_fields())

    def drop(self, job: Job, why: str) -> None:
        """Stop working on a job we no longer own or can no longer report on; writes nothing."""
        self._out_of_engine(job)
        job.pending.clear()
        self.pop(job.job_id, None)
        self.log.warning("dropped", why=why, **job.log_fields())

    def abort_all(self) -> None:
        for job in self.values():
            self._out_of_engine(job)
