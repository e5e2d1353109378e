"""One job as an HTTP answer: a whole OpenAI response, or server-sent chunks.

``JobFeed`` reads the job's deltas through the client's shared result readers
(``producer_sdk/core/hub.py``): the request holds no Redis connection while it waits, ``next(t)``
returns within ``t`` (so a stream sends ``: keep-alive`` comments while the job waits in its
queue, and a whole answer notices a client that left), and ``close`` is synchronous: a request
torn down by its client's disconnect drops its reader registration at once and hands the
job's cancel to ``Cancels``, which retries it until it lands. The SDK's state already dedupes
and resumes across worker takeovers, so what is relayed here is each token once, in order,
whatever happens to workers; its deadline and lost-job rules end the job on time.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Union

from tokenrelay.producer_sdk.aio import AsyncJob
from tokenrelay.producer_sdk.gateway.backend import Submitted
from tokenrelay.producer_sdk.gateway.cancels import Cancels
from tokenrelay.protocol.fold import Delta
from tokenrelay.producer_sdk.jobs.job import Result, StreamCursor
from tokenrelay.protocol.logprobs import TokenLogprob
from tokenrelay.producer_sdk.openai.format import (OpenAIRequest, choice_body, chunk_body, chunk_choice,
                                        completion_body, logprobs_body, token_logprobs_of,
                                        usage_body)
from tokenrelay.producer_sdk.gateway.errors import APIError, api_error, cancelled, timed_out
from tokenrelay.producer_sdk.gateway.metrics import GatewayMetrics
from tokenrelay.producer_sdk.gateway.resume import Marks, bad_event_id, sse_event
from tokenrelay.producer_sdk.openai.tool_calls import CallReader, finish_reason, relay, whole_choice

KEEPALIVE = ": keep-alive\n\n"
# Once an event with an id went out, a keep-alive is the comment line alone: the openai
# package's SSE decoder (1.x, _streaming.SSEDecoder) dispatches an event at every blank line
# once it holds a last event id, even with no data, and then fails to parse that empty data
# as JSON; a comment line without a blank line is skipped by every SSE parser.
KEEPALIVE_LINE = ": keep-alive\n"
DONE = "data: [DONE]\n\n"
_END = object()


class JobFeed:
    """A job's deltas for one answer: ``next(timeout)`` returns a list of deltas, ``None``
    when nothing came within ``timeout``, or ``_END``; it raises what ended the job (APIError
    504 once the request's total time is up). ``close()`` must follow, once. ``on_close``
    (a resumable stream's) replaces the cancel of a job that did not end: it is called with
    whether it ended and whether the feed gave up (the request's time ran out, its reader
    lost Redis): then no resume is waited for."""

    def __init__(self, sub: Submitted, cancels: Cancels, retry_after_s: int = 1,
                 on_close: Optional[Callable[[bool, bool], None]] = None) -> None:
        self.on_close = on_close
        self.job: AsyncJob = sub.job
        self.ends_at = sub.ends_at
        self.total_s = None if sub.ends_at is None else round(sub.ends_at - time.monotonic(), 3)
        self.cancels = cancels
        self.retry_after_s = retry_after_s
        self.hub = self.job.client.hub
        self._watching = self.hub.watching(self.job)
        self.watch = self._watching.__enter__()
        self.cursor = StreamCursor(self.job, None)
        self.ended = False
        self.gave_up = False
        self.closed = False

    async def next(self, timeout: float) -> Any:
        for attempt in (0, 1):
            try:
                deltas = self.cursor.take()
            except Exception as exc:    # the job failed (JobFailed), or ended by a reader
                self.ended = True
                raise api_error(exc, self.retry_after_s) from None
            if deltas is None:
                self.ended = True
                return _END
            if deltas or attempt:
                return deltas or None
            wait = timeout
            if self.ends_at is not None:
                left = self.ends_at - time.monotonic()
                if left <= 0:
                    self.gave_up = True
                    raise timed_out(self.job.id, self.total_s, self.job.state.started)
                wait = min(wait, left)
            try:
                await self.hub.wait(self.watch, wait)
            except Exception as exc:    # its reader gave up (Redis gone past redis_retry_s)
                self.gave_up = True
                raise api_error(exc, self.retry_after_s) from None
        return None

    def hung_up(self) -> None:
        """From the hang-up watcher's thread (gateway/hangups.py): the client left a stream
        whose job is cancelled when it does; owe that cancel now, before the loop's ``close``
        (which owes it again: ``Cancels`` holds it once, the script is idempotent)."""
        if not (self.ended or self.closed):
            self.cancels.add(self.job.cancel_target)

    def close(self) -> None:
        """Drop the reader registration now; cancel the job unless it ended."""
        if self.closed:
            return
        self.closed = True
        self.cursor.__exit__(None, None, None)
        self._watching.__exit__(None, None, None)
        if self.on_close is not None:
            self.on_close(self.ended, self.gave_up)
        elif not self.ended:
            self.cancels.add(self.job.cancel_target)


@dataclass
class Choice:
    """What was relayed of one choice: its text so far and its logprob records."""

    text_len: int = 0
    parts: list[str] = field(default_factory=list)
    records: list[TokenLogprob] = field(default_factory=list)
    finish_reason: Optional[str] = None
    opened: bool = False            # chat: the role chunk was sent
    echoed: bool = False            # completions with echo: the prompt was sent
    calls: Optional[CallReader] = None  # with tools: the calls read from the text so far


@dataclass
class Answer:
    """One request being answered: its parsed body, job and what was relayed per choice."""

    req: OpenAIRequest
    job: AsyncJob
    model: str
    top: int
    created: int = field(default_factory=lambda: int(time.time()))
    choices: dict[int, Choice] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)

    def choice(self, index: int) -> Choice:
        if index not in self.choices:
            tools = self.req.tools
            self.choices[index] = Choice(calls=CallReader(tools) if tools else None)
        return self.choices[index]

    def add(self, delta: Delta) -> list[dict[str, Any]]:
        """Fold one delta in; the chunk choices that relay it."""
        c = self.choice(delta.index)
        echo = self._echo(c)
        records = token_logprobs_of(delta) if self.req.logprobs else []
        lp = logprobs_body(self.req.chat, records, self.top, c.text_len) if records else None
        c.records.extend(records)
        c.parts.append(delta.text)
        c.text_len += len(delta.text)
        out = []
        if self.req.chat and not c.opened:
            c.opened = True
            out.append(chunk_choice(True, delta.index, "", None, None, role=True))
        if c.calls is not None:           # content and tool-call deltas
            out.extend(relay(c.calls, self.job.id, delta.index, delta.text, lp,
                             delta.finish_reason))
            c.finish_reason = finish_reason(c.calls, delta.finish_reason)
        elif echo or delta.text or lp or delta.finish_reason:
            c.finish_reason = delta.finish_reason
            out.append(chunk_choice(self.req.chat, delta.index, echo + delta.text, lp,
                                    delta.finish_reason))
        return out

    def _echo(self, c: Choice) -> str:
        """The prompt, once per choice, in its first chunk (completions with ``echo``)."""
        if self.req.echo is None or c.echoed:
            return ""
        c.echoed = True
        return self.req.echo

    def closing(self, result: Result) -> list[dict[str, Any]]:
        """Chunk choices ending every choice the deltas did not end (and opening any that
        produced nothing), from the job's result."""
        out = []
        for o in result.outputs:
            c = self.choice(o.index)
            if self.req.chat and not c.opened:
                c.opened = True
                out.append(chunk_choice(True, o.index, "", None, None, role=True))
            if c.finish_reason is None and c.calls is not None:
                out.extend(relay(c.calls, self.job.id, o.index, "", None, o.finish_reason))
                c.finish_reason = finish_reason(c.calls, o.finish_reason)
            elif c.finish_reason is None:
                c.finish_reason = o.finish_reason
                out.append(chunk_choice(self.req.chat, o.index,
                                        None if self.req.chat else self._echo(c), None,
                                        o.finish_reason))
        return out

    def chunk(self, choices: list[dict[str, Any]], usage: Any = ...) -> dict[str, Any]:
        if usage is ... and self.req.include_usage:
            usage = None
        return chunk_body(self.req.chat, self.job.id, self.created, self.model, choices, usage)

    def whole(self, result: Result) -> dict[str, Any]:
        """The non-streamed response body."""
        choices = []
        for o in result.outputs:
            c = self.choices.get(o.index) or Choice()
            records = c.records or (token_logprobs_of(o) if self.req.logprobs else [])
            lp = logprobs_body(self.req.chat, records, self.top) if self.req.logprobs else None
            if self.req.tools is not None:
                choices.append(whole_choice(self.req.tools, self.job.id, o.index, o.text, lp,
                                            o.finish_reason))
                continue
            choices.append(choice_body(self.req.chat, o.index, (self.req.echo or "") + o.text,
                                       lp, o.finish_reason))
        return completion_body(self.req.chat, self.job.id, self.created, self.model, choices,
                               usage_of(result))


def usage_of(result: Result) -> dict[str, int]:
    return usage_body(result.usage.prompt_tokens, result.usage.completion_tokens)


def sse(data: Any, event_id: Optional[str] = None) -> str:
    return sse_event(event_id, json.dumps(data, ensure_ascii=False, separators=(",", ":")))


def finished_result(answer: Answer) -> Result:
    """The job's Result once its stream ended; APIError for a failed or cancelled job."""
    try:
        result = answer.job.state.result()
    except Exception as exc:
        raise api_error(exc) from None
    if result.finish_reason == "cancelled":
        raise cancelled(answer.job.id)
    return result


def _count(metrics: GatewayMetrics, result: Result) -> None:
    metrics.tokens.labels("prompt").inc(result.usage.prompt_tokens)
    metrics.tokens.labels("completion").inc(result.usage.completion_tokens)


async def whole_response(answer: Answer, feed: JobFeed,
                         disconnected: Callable[[], Awaitable[bool]],
                         metrics: GatewayMetrics, poll_s: float = 0.5) -> Optional[dict]:
    """Wait for the job and build its body; None (and the job cancelled) when the client left.
    The feed is closed here, whatever happens."""
    checked = time.monotonic()
    try:
        while True:
            item = await feed.next(poll_s)
            if item is _END:
                break
            if time.monotonic() - checked >= poll_s:    # every poll_s, however busy the job
                checked = time.monotonic()
                if await disconnected():
                    metrics.cancelled.inc()
                    return None
            for delta in item or ():
                if not answer.choices:
                    metrics.ttft.observe(time.monotonic() - answer.started)
                answer.add(delta)
        result = finished_result(answer)
        _count(metrics, result)
        return answer.whole(result)
    finally:
        feed.close()


async def first_item(feed: JobFeed, wait_s: float) -> Any:
    """The first deltas, or None after ``wait_s``: an error that comes this early is still
    answered with its HTTP status (APIError), before any byte of the stream is sent."""
    ends = time.monotonic() + wait_s
    try:
        while True:
            item = await feed.next(max(0.0, ends - time.monotonic()))
            if item is not None or time.monotonic() >= ends:
                return item
    except BaseException:
        feed.close()
        raise


class Renderer:
    """The SSE events of one streamed answer, each with its id (``resume.Marks``); a resumed
    stream renders every event again, for the answer's state, and returns only those past its
    resume point. Token counts and time to first token are a request's own: a resume counts
    neither again."""

    def __init__(self, answer: Answer, marks: Marks, metrics: GatewayMetrics,
                 resumed: bool = False) -> None:
        self.answer = answer
        self.marks = marks
        self.metrics = metrics
        self.resumed = resumed

    def _event(self, data: Any) -> list[str]:
        event_id = self.marks.stamp()
        return [] if event_id is None else [sse(data, event_id)]

    def _done(self) -> list[str]:
        event_id = self.marks.stamp()
        return [] if event_id is None else [sse_event(event_id, "[DONE]")]

    def deltas(self, deltas: list[Delta]) -> list[str]:
        out: list[str] = []
        for delta in deltas:
            if not self.answer.choices and not self.resumed:
                self.metrics.ttft.observe(time.monotonic() - self.answer.started)
            self.marks.delta(delta.seq)
            for choice in self.answer.add(delta):
                out += self._event(self.answer.chunk([choice]))
        return out

    def ending(self) -> list[str]:
        """The closing chunks, the usage chunk when asked for, ``[DONE]``; APIError for a job
        that failed or was cancelled."""
        result = finished_result(self.answer)
        if not self.resumed:
            _count(self.metrics, result)
        out: list[str] = []
        for choice in self.answer.closing(result):
            out += self._event(self.answer.chunk([choice]))
        if self.answer.req.include_usage:
            out += self._event(self.answer.chunk([], usage_of(result)))
        return out + self._done()

    def failure(self, err: APIError) -> list[str]:
        """A failure after the status was sent: an ``error`` event, then ``[DONE]``, both with
        the id of the job's last event sent (none before the first): some failures are this
        connection's own (its total time, Redis gone, a takeover), not the job's, so the
        client's Last-Event-ID stays on the job's last event and a resume renders what the
        job itself says from there."""
        last = self.marks.last
        return [sse(err.body(), last), sse_event(last, "[DONE]")]


async def catch_up(renderer: Renderer, feed: JobFeed, wait_s: float) -> tuple[list[str], Any]:
    """A resumed stream, up to its resume point (within ``wait_s``, or until the job ended):
    the events already due after it, and the feed's next item (``_END`` once the ending is
    among them). APIError 400 for a point the stream never had, 410 for a result stream that
    no longer holds the events before it (``Marks``); the feed is closed then. Past
    ``wait_s`` the stream starts anyway (headers go out) and skips on from there."""
    ends = time.monotonic() + wait_s
    ready: list[str] = []
    try:
        while not renderer.marks.reached:
            item = await feed.next(max(0.0, ends - time.monotonic()))
            if item is _END:
                ready += _ending_or_failure(renderer)
                if not renderer.marks.reached:
                    raise bad_event_id(renderer.marks.after.text(),  # type: ignore[union-attr]
                                       "names no event of this stream")
                return ready, _END
            ready += renderer.deltas(item or [])
            if item is None and time.monotonic() >= ends:
                break
        return ready, None
    except BaseException:
        feed.close()
        raise


def _ending_or_failure(renderer: Renderer) -> list[str]:
    try:
        return renderer.ending()
    except APIError as err:
        return renderer.failure(err)


async def event_stream(renderer: Renderer, feed: JobFeed, ready: list[str], first: Any,
                       keepalive_s: float, superseded: Optional[Callable[[], Awaitable[bool]]]
                       = None) -> AsyncIterator[str]:
    """The SSE body: ``ready`` (a resume's events due at once), then chunks as deltas come,
    keep-alive comments while none does, the closing chunks, the usage chunk when asked for,
    ``[DONE]``. A failure after the first byte is sent as an ``error`` event (what the openai
    client raises from). A client that leaves ends the feed (``feed.close``: its job is
    cancelled, or parked for a resume). ``superseded`` is asked after each wait (it keeps its
    own pace): a stream another connection resumed ends with a ``stream_taken_over`` error
    event. The events of one wake go out as one chunk (one send, one write on the socket):
    with 2,000 streams on a busy loop a wake carries several deltas, and a send per event was
    CPU that made every turn of the loop, a disconnect's noticed among them, slower (#42)."""
    ided = False                    # an event with an id went out on this connection
    try:
        if ready:
            ided = True
            yield "".join(ready)
        item: Union[list[Delta], None, object] = first
        if first is _END:
            return
        while item is not _END:
            if item is None:
                yield KEEPALIVE_LINE if ided else KEEPALIVE
            else:
                events = renderer.deltas(item)  # type: ignore[arg-type]
                if events:
                    ided = True
                    yield "".join(events)
            if superseded is not None and await superseded():
                raise taken_over(feed.job.id)
            item = await feed.next(keepalive_s)
        yield "".join(renderer.ending())
    except APIError as err:
        yield "".join(renderer.failure(err))
    finally:
        if not feed.ended and feed.on_close is None:
            renderer.metrics.cancelled.inc()
        feed.close()


def taken_over(job_id: str) -> APIError:
    return APIError(409, f"another connection resumed the stream of job {job_id} "
                    f"(Last-Event-ID); this one ends here", "invalid_request_error", None,
                    "stream_taken_over")
