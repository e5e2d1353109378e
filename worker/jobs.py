"""The jobs this worker holds: each one's entry, request, ownership and the events it owes.

No Redis I/O: the loop turns engine deltas into events here and the outbox ships ``pending``
once per step. Keeping the emitted tokens and text lets the
worker re-add a job to the engine with a resume state after an engine failure, and count
partial output in ``usage`` when a job is cancelled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import msgpack

from producer_sdk.protocol import (DoneEvent, ErrorCode, ErrorEvent, FinishReason, JobRequest,
                                   StartedEvent, Timings, Usage, encode_event)
from worker.pending import Entry


def encode_token_event(seq: int, index: int, text: str, token_ids: list[int],
                       logprobs: Optional[list[dict[int, float]]], ts: float) -> bytes:
    """``encode_event(TokenEvent(...))`` without pydantic: token events are the hot path (one per
    running job per step) and this is 4x cheaper. Same bytes-level schema (test_protocol)."""
    ev: dict[str, Any] = {"type": "token", "seq": seq, "index": index, "text": text,
                          "token_ids": [int(t) for t in token_ids], "ts": ts}
    if logprobs is not None:
        ev["logprobs"] = [{int(k): float(v) for k, v in d.items()} for d in logprobs]
    return msgpack.packb(ev, use_bin_type=True)


@dataclass
class Job:
    entry: Entry
    request: JobRequest
    owner: str                           # "<worker_id>:<token>" written to Keys.owner
    worker_id: str
    seed: int = 0
    attempt: int = 1
    want_logprobs: bool = False
    next_seq: int = 0                    # seq of the next token event
    out_ids: list[int] = field(default_factory=list)    # all output tokens (incl. resumed)
    out_text: list[str] = field(default_factory=list)   # all output text pieces (incl. resumed)
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
    unsure: bool = False                 # the last write's reply was lost: check before retrying
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

    @property
    def batch_id(self) -> str:
        return f"{self.owner.rsplit(':', 1)[-1]}.{self.batch_no}"

    @property
    def text(self) -> str:
        return "".join(self.out_text)

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
        """Record one engine delta; queue a token event (stream jobs) and, when finished, the
        done event. Returns True when this delta carried the first token of this attempt."""
        first = False
        if delta.new_token_ids or delta.new_text:
            if self.first_token_at is None:
                self.first_token_at, first = ts, True
            self.last_token_at = ts
            if self.request.stream:
                self.pending.append(encode_token_event(
                    self.next_seq, len(self.out_ids), delta.new_text, delta.new_token_ids,
                    delta.logprobs if self.want_logprobs else None, ts))
                self.next_seq += 1
            self.out_ids.extend(delta.new_token_ids)
            self.out_text.append(delta.new_text)
        self.prompt_tokens = delta.num_prompt_tokens or self.prompt_tokens
        if delta.finished:
            self.finish(delta.finish_reason or FinishReason.STOP.value, delta.stop_reason,
                        completion_tokens=delta.num_output_tokens)
        return first

    def finish(self, reason: str, stop_reason: Any = None,
               completion_tokens: Optional[int] = None) -> None:
        self.finished_at = time.time()
        self.terminal, self.finish_reason = "done", reason
        full = not self.request.stream
        self.pending.append(encode_event(DoneEvent(
            finish_reason=reason, stop_reason=stop_reason,
            usage=Usage(prompt_tokens=self.prompt_tokens,
                        completion_tokens=(completion_tokens if completion_tokens is not None
                                           else len(self.out_ids))),
            timings=self.timings(), metadata=self.request.metadata,
            text=self.text if full else None, token_ids=list(self.out_ids) if full else None)))

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

    def _out_of_engine(self, job: Job) -> None:
        if job.in_engine:
            self.engine.abort_request(job.job_id)
            job.in_engine = False

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
        self.log.info("cancelled", why=why, tokens=len(job.out_ids), **job.log_fields())

    def drop(self, job: Job, why: str) -> None:
        """Stop working on a job we no longer own or can no longer report on; writes nothing."""
        self._out_of_engine(job)
        job.pending.clear()
        self.pop(job.job_id, None)
        self.log.warning("dropped", why=why, **job.log_fields())

    def abort_all(self) -> None:
        for job in self.values():
            self._out_of_engine(job)
