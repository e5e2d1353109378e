"""Admission: from a held entry to a running engine request, or to a rejection of that entry alone.

For each entry read: skip what is already held, ack what was deleted, dead-letter what was
delivered too often, decode and validate the payload (any failure ends this job alone with an
error event naming the field when the job id can be read), then, in one pipeline for the batch,
bind the job id to this entry and take ownership (identity: a second entry reusing a live job's
id is rejected as duplicate_job_id and touches nothing of that job), read the cancel flag and
the result stream (resume), and add the request to the engine. A transient Redis error on that
pipeline puts the whole batch back untouched: ``StartDeferred`` tells the loop which entries.
"""

from __future__ import annotations

import random
from typing import Any, Optional, Union

from pydantic import ValidationError

from tokenrelay.engine.errors import InvalidRequestError, PromptTooLongError
from tokenrelay.engine.outputs import ResumeState
from tokenrelay.protocol.errors import ErrorCode, FinishReason, ProtocolError, describe_validation_error
from tokenrelay.protocol.keys import Keys, PAYLOAD_FIELD
from tokenrelay.protocol.limits import Limits
from tokenrelay.protocol.sampling_params import SamplingParams, default_max_tokens
from tokenrelay.protocol.scripts import ScriptPipeline, text
from tokenrelay.protocol.wire import JobRequest, decode_job, now_ms
from tokenrelay.worker.config import WorkerSettings
from tokenrelay.worker.connection import ErrorKind, classify
from tokenrelay.worker.deadletters import Rejection, payload_job_id
from tokenrelay.worker.engine_api import EngineAPI
from tokenrelay.worker.entries import Entry, EntryKey, entry_fields
from tokenrelay.worker.fencing import Fence, bound, entry_lost, new_owner_value
from tokenrelay.worker.jobs import Choice, Job, JobTable
from tokenrelay.worker.metrics import WorkerMetrics
from tokenrelay.worker.outbox import Outbox
from tokenrelay.worker.pending import PendingList
from tokenrelay.worker.recovery import JobProgress, progress_from_entries
from tokenrelay.worker.sampling_defaults import SamplingDefaults
from tokenrelay.worker.token_text import TokenTexts
from tokenrelay.worker.connection import RedisClient
from tokenrelay.worker.logs import Log


class StartDeferred(Exception):
    """A transient Redis error hit the start pipeline: none of ``entries`` was started or
    rejected. The loop takes them again after its backoff (as they are: no re-read, so no
    delivery is counted) and handles ``cause`` as any transient error."""

    def __init__(self, entries: list[Entry], cause: Exception) -> None:
        super().__init__(f"start of {len(entries)} entries deferred: {cause}")
        self.entries = entries
        self.cause = cause


def stream_entries(reply: Any) -> list[tuple[Any, dict]]:
    """A raw XRANGE reply (``ScriptPipeline`` applies no response callbacks) as (id, fields)."""
    return [(eid, entry_fields(flat)) for eid, flat in reply or []]


def _params_message(msg: str) -> str:
    return "; ".join(p if p.startswith("params") else f"params.{p}" for p in msg.split("; "))


class Admission:
    """Admits entries into the worker's JobTable and engine; see the module docstring."""

    def __init__(self, client: RedisClient, keys: Keys, worker_id: str, settings: WorkerSettings,
                 limits: Limits, engine: EngineAPI, jobs: JobTable, fence: Fence,
                 outbox: Outbox, pending: PendingList, metrics: WorkerMetrics,
                 log: Log) -> None:
        self.client = client
        self.keys = keys
        self.worker_id = worker_id
        self.s = settings
        self.ttl_ms = settings.result_ttl_ms
        self.limits = limits
        self.engine = engine
        self.jobs = jobs
        self.fence = fence
        self.outbox = outbox
        self.pending = pending
        self.metrics = metrics
        self.log = log
        self._token_texts: Optional[TokenTexts] = None
        self.defaults = SamplingDefaults.load(settings, log)   # --generation-config

    def admit(self, entries: list[Entry], held: set[EntryKey]) -> None:
        """Start or settle every entry of ``entries`` that is not among ``held`` (what the
        worker holds already: jobs, owed acks and rejections, entries read but not started).
        Raises ``StartDeferred`` on a transient Redis error."""
        held = set(held)
        fresh: list[tuple[Entry, JobRequest]] = []
        recount: list[tuple[str, str, int]] = []
        for e in entries:
            if e.key in held:
                if e.source in ("pending", "reclaimed"):
                    # our own re-read after a reconnect, or our own reclaim after renewals
                    # failed (e.g. Redis out of memory), counted a delivery: undo it
                    recount.append((e.lane_key, e.entry_id, e.deliveries - 1))
                continue
            held.add(e.key)
            req = self._screen(e)
            if req is None:
                continue
            if req.job_id in self.jobs or any(r.job_id == req.job_id for _, r in fresh):
                self._reject(e, ErrorCode.DUPLICATE_JOB_ID, f"job_id {req.job_id!r} is already running on this "
                             "worker under another entry (submitted twice?)", req.job_id, {})
                continue
            fresh.append((e, req))
        if recount:
            self.pending.restore_counts(recount)
        if fresh:
            self._start_all(fresh)

    def _screen(self, e: Entry) -> Optional[JobRequest]:
        """The entry's request, or None when the entry was settled here (acked or rejected)."""
        if e.fields is None:
            self.log.warning("pending entry was deleted from the stream; acknowledging it",
                             entry_id=e.entry_id, lane=e.lane)
            self.outbox.owe_ack(e, None, "deleted")
            return None
        if e.deliveries > self.s.max_deliveries:  # e.g. a prompt that kills every worker
            job_id = payload_job_id(e.payload)
            self._reject(e, ErrorCode.POISON,
                         f"job dead-lettered: delivered {e.deliveries} times, more than "
                         f"max_deliveries={self.s.max_deliveries}; each holder died or failed "
                         "before finishing it", job_id,
                         {"entry_id": e.entry_id, "deliveries": e.deliveries})
            return None
        try:
            req = self._decode(e)
        except ProtocolError as exc:
            self._log_received(e, exc.job_id)
            self._reject(e, exc.code, str(exc), exc.job_id, exc.metadata)
            return None
        except Exception as exc:  # a decoder bug must end this entry alone, never the worker
            self.log.exception("payload could not be decoded", entry_id=e.entry_id)
            self._reject(e, ErrorCode.INTERNAL, f"payload could not be decoded: "
                         f"{type(exc).__name__}: {exc}", None, {})
            return None
        self._log_received(e, req.job_id)
        return req

    def _decode(self, e: Entry) -> JobRequest:
        if e.payload is None:
            raise ProtocolError(f"entry has no {PAYLOAD_FIELD.decode()!r} field (expected the "
                                "msgpack JobRequest)")
        return decode_job(e.payload, self.limits)

    def _log_received(self, e: Entry, job_id: Optional[str]) -> None:
        self.log.debug("received", job_id=job_id, entry_id=e.entry_id, lane=e.lane,
                       source=e.source, deliveries=e.deliveries)

    def _reject(self, e: Entry, code: ErrorCode, message: str, job_id: Optional[str],
                metadata: dict) -> None:
        self.outbox.reject(Rejection(e, code.value, message, job_id, metadata))
        self.metrics.errors.labels(code.value).inc()
        self.log.warning("failed", code=code.value, error=message, job_id=job_id,
                         entry_id=e.entry_id, lane=e.lane, dead_letter=True)

    # ---------------------------------------------------------------- the start pipeline
    def _start_all(self, fresh: list[tuple[Entry, JobRequest]]) -> None:
        """Bind, own, read the cancel flag and the result stream of every job: one round trip.
        A transient error (e.g. Redis out of memory) puts the whole batch back, untouched, for
        a retry after backoff (``StartDeferred``); another error on one job's keys ends that job
        alone."""
        pipe = ScriptPipeline(self.client)
        owners, idx = [], []
        for e, req in fresh:   # the job's keys are those of the shard its entry came from
            owners.append(new_owner_value(self.worker_id))
            idx.append((self.fence.bind_and_own(pipe, req.job_id, e.shard, e.lane_key,
                                                e.entry_id, owners[-1], self.ttl_ms),
                        pipe.command("EXISTS", self.keys.cancel(req.job_id, e.shard)),
                        pipe.command("XRANGE", self.keys.results(req.job_id, e.shard), "-", "+")))
        res = pipe.execute()
        errors = [r for r in res if isinstance(r, Exception)]
        transient = next((x for x in errors if classify(x) is not ErrorKind.OTHER), None)
        if transient is not None:
            raise StartDeferred([e for e, _ in fresh], transient)
        for (e, req), owner, (i_own, i_cancel, i_range) in zip(fresh, owners, idx):
            bad = next((r for r in (res[i_own], res[i_cancel], res[i_range])
                        if isinstance(r, Exception)), None)
            if bad is not None:  # e.g. WRONGTYPE on a per-job key: this job only
                self._reject(e, ErrorCode.INTERNAL, f"cannot use the job's keys: {bad}",
                             req.job_id, req.metadata)
            elif entry_lost(res[i_own]):   # no dead letter: that would recreate its stream
                self.log.warning("job lost: Redis no longer holds its entry (it came back "
                                 "without its data); not running it, writing nothing (its "
                                 "readers enqueue it again or end it job_lost)",
                                 job_id=req.job_id, entry_id=e.entry_id, lane=e.lane)
                self.outbox.owe_ack(e, req.job_id, "lost")
            elif not bound(res[i_own]):
                self._reject(e, ErrorCode.DUPLICATE_JOB_ID, f"job_id {req.job_id!r} belongs to another entry "
                             f"({text(res[i_own])}); give each job its own id", req.job_id, {})
            else:
                job = Job(entry=e, request=req, owner=owner, worker_id=self.worker_id)
                self.jobs[req.job_id] = job
                self._start_guarded(job, stream_entries(res[i_range]), bool(res[i_cancel]))

    def _start_guarded(self, job: Job, stream: Any, cancelled: bool) -> None:
        try:
            progress = progress_from_entries(stream or [])
            job.stream_len = progress.entries
            self._start(job, progress, cancelled)
        except Exception as exc:  # any failure admitting one job ends that job alone
            self.log.exception("job could not be started", **job.log_fields())
            self.jobs.fail(job, ErrorCode.INTERNAL, f"the worker could not start the job: "
                             f"{type(exc).__name__}: {exc}")

    def _start(self, job: Job, progress: JobProgress, cancelled: bool) -> None:
        req = job.request
        if progress.finished:
            self.log.info("already finished; acknowledging", **job.log_fields())
            job.terminal = progress.terminal.type
            self.outbox.owe_ack(job.entry, job.job_id, "already finished")
            return
        if req.model is not None and req.model != self.s.served_model():
            self.jobs.fail(job, ErrorCode.INVALID_REQUEST, wrong_model(req.model, self.s))
            return
        job.attempt = progress.attempts + 1
        if req.stream and progress.choices:
            resume_choices(job, progress)
        params = self._params(job)
        if params is None:
            return
        job.shape(params.num_choices, params.num_choices > 1 or params.use_beam_search)
        if cancelled:
            self.jobs.cancel(job, "cancel flag set before start")
            return
        if req.deadline_ms is not None and progress.attempts == 0 and now_ms() > req.deadline_ms:
            late = now_ms() - req.deadline_ms
            self.jobs.fail(job, ErrorCode.EXPIRED, f"deadline_ms={req.deadline_ms} passed "
                           f"{late} ms before a worker could start the job; raise the deadline "
                           "or add workers")
            return
        seed = progress.seed if progress.seed is not None else params.seed
        if seed is None:
            seed = random.SystemRandom().randrange(2**63)
        params.seed = job.seed = seed
        job.want_logprobs = params.logprobs is not None
        if job.want_logprobs:
            job.token_texts = self._texts()
        job.params = params
        prompt = self._engine_prompt(job)
        if prompt is None:
            return
        for c in job.choices:   # taken over right after a choice's last token
            if c.finish_reason is None and len(c.ids) >= params.max_tokens:
                c.finish_reason = FinishReason.LENGTH.value
        if job.all_finished():
            job.finish()
            self.log.info("finished", finish_reason=job.finish_reason, tokens=job.tokens,
                          **job.log_fields())
            return
        self._add_to_engine(job, prompt)
        if job.terminal is None:
            job.queue_started()
            self.metrics.queue_time.observe(max(0.0, job.admitted_at - job.enqueued_ms / 1000))
            fields = job.log_fields()
            if self.s.log_prompts:
                fields["prompt"] = req.prompt or req.messages or req.prompt_token_ids
            self.log.info("started", attempt=job.attempt, resumed_tokens=job.resumed_tokens,
                          priority=req.priority, **fields)

    def _texts(self) -> TokenTexts:
        """The text and bytes of the engine's tokens, for jobs that ask for logprobs (made on
        first use: a worker whose jobs never ask decodes nothing)."""
        if self._token_texts is None:
            self._token_texts = TokenTexts(self.engine.tokenizer)
        return self._token_texts

    def _params(self, job: Job) -> Any:
        """The job's SamplingParams, or None after failing the job (the producer's fault)."""
        try:
            return SamplingParams.model_validate(self.defaults.apply(job.request.params))
        except ValidationError as exc:
            msg = _params_message(describe_validation_error(exc))
        except (ValueError, TypeError) as exc:
            msg = f"params: {type(exc).__name__}: {exc}"
        self.jobs.fail(job, ErrorCode.INVALID_REQUEST, "invalid sampling params: " + msg)
        return None

    def _prompt(self, req: JobRequest) -> Any:
        if req.prompt is not None:
            return req.prompt
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        # As LLM.chat does: the rendered template already holds BOS and friends.
        text_ = self.engine.render_chat([m.model_dump() for m in req.messages],
                                        req.chat_template_kwargs, req.tool_dicts())
        return list(self.engine.tokenizer.encode(text_, add_special_tokens=False))

    def _engine_prompt(self, job: Job) -> Any:
        """The prompt for the engine (a chat job's rendered and tokenized), with ``max_tokens``
        resolved for a job that did not set it; None after failing the job."""
        try:
            prompt = self._prompt(job.request)
            resolve_max_tokens(job.params, job.request, len(prompt) if isinstance(prompt, list)
                               else 0, self.engine.max_model_len,
                               self.defaults.max_tokens_for(job.request.params))
            return prompt
        except Exception as exc:
            self._refused(job, exc, "the job's prompt could not be built")
            return None

    def _add_to_engine(self, job: Job, prompt: Any) -> None:
        """engine.add_request, mapping every refusal to the job's error event; never raises."""
        try:
            resume = resume_state(job)
            self.engine.add_request(job.job_id, prompt, job.params,
                                    priority=job.request.priority, resume=resume,
                                    owner=job.request.producer)
            job.in_engine = True
        except Exception as exc:
            self._refused(job, exc, "engine refused the job unexpectedly")

    def _refused(self, job: Job, exc: Exception, unexpected: str) -> None:
        """End the job for ``exc``: the producer's fault (the engine's numbers or the field in
        the message), or ``internal`` for anything else."""
        if isinstance(exc, PromptTooLongError):
            self.jobs.fail(job, ErrorCode.PROMPT_TOO_LONG, str(exc))
        elif isinstance(exc, ValidationError):
            self.jobs.fail(job, ErrorCode.INVALID_REQUEST, "invalid sampling params: "
                           + _params_message(describe_validation_error(exc)))
        elif isinstance(exc, (InvalidRequestError, ValueError, TypeError)):
            self.jobs.fail(job, ErrorCode.INVALID_REQUEST, f"{type(exc).__name__}: {exc}")
        else:
            self.log.exception(unexpected, **job.log_fields())
            self.jobs.fail(job, ErrorCode.INTERNAL,
                           f"{unexpected}: {type(exc).__name__}: {exc}")


def wrong_model(asked: str, settings: WorkerSettings) -> str:
    """Why a worker refuses a job for another model: answering it would label one model's
    text with another's name (a queue's workers serve one model; a worker restarted with
    another model finds its predecessor's jobs)."""
    return (f"model: the job asks for {asked!r} but the workers of queue {settings.queue!r} "
            f"serve {settings.served_model()!r}; send it to the queue that serves {asked!r} "
            f"(route by model: submit(model=...), the gateway, the batch runner)")


def resolve_max_tokens(params: Any, request: JobRequest, prompt_tokens: int,
                       max_model_len: int, default: Optional[int] = None) -> None:
    """``max_tokens`` of a job that did not set it: the contract's ``default_max_tokens``
    (``default``: generation_config.json's max_new_tokens), at least 1 (past the context the
    engine answers prompt_too_long). Set explicitly even when it is the schema's default, so
    ``min_tokens`` is checked against it (ValidationError)."""
    if "max_tokens" in request.params:
        return
    params.max_tokens = max(1, default_max_tokens(request.messages is not None,
                                                  max_model_len - prompt_tokens, default))


def resume_choices(job: Job, progress: JobProgress) -> None:
    """What the client already holds of each choice (the fold of its stream), and which choices
    it already saw finish: the job continues from there, seq after the last token event."""
    job.next_seq = progress.next_seq
    top = max(progress.choices) + 1
    job.choices = [Choice() for _ in range(top)]
    for index, folded in progress.choices.items():
        job.choices[index] = Choice(ids=list(folded.token_ids), parts=[folded.text],
                                    finish_reason=folded.finish_reason,
                                    stop_reason=folded.stop_reason,
                                    cumulative_logprob=folded.cumulative_logprob)
    job.resumed_tokens = job.tokens


def resume_state(job: Job) -> Union[None, ResumeState, list[ResumeState]]:
    """The engine's resume argument (docs/contracts.md): None for a fresh job and for beam
    search (rerun: it is deterministic, and the beams a takeover already delivered are dropped
    by ``Job.on_delta``); one ResumeState for n == 1; one per choice for n > 1."""
    if job.params.use_beam_search:
        return None
    states = [ResumeState(output_token_ids=list(c.ids), output_text=c.text,
                          finish_reason=c.finish_reason, stop_reason=c.stop_reason)
              for c in job.choices]
    if not any(s.output_token_ids or s.finish_reason for s in states):
        return None
    return states[0] if len(states) == 1 else states
