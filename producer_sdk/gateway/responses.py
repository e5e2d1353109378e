"""One job as an HTTP answer: a whole OpenAI response, or server-sent chunks.

``JobFeed`` reads the job's deltas in a task of its own into a queue, so the HTTP side can wait
for the next one with a timeout -- to send ``: keep-alive`` comments while the job waits in its
queue (proxies cut idle streams), and to notice a client that left -- without ever cancelling
the SDK's own stream mid-read. The SDK's stream already dedupes and resumes across worker
takeovers, so what is relayed here is each token once, in order, whatever happens to workers.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Union

import anyio

from producer_sdk.aio import AsyncJob
from protocol.fold import Delta
from producer_sdk.job import Result
from protocol.logprobs import TokenLogprob
from producer_sdk.openai_format import (OpenAIRequest, choice_body, chunk_body, chunk_choice,
                                        completion_body, logprobs_body, token_logprobs_of,
                                        usage_body)
from producer_sdk.gateway.errors import APIError, api_error, cancelled
from producer_sdk.gateway.metrics import GatewayMetrics
from producer_sdk.tool_calls import CallReader, finish_reason, relay, whole_choice

KEEPALIVE = ": keep-alive\n\n"
DONE = "data: [DONE]\n\n"
_END = object()
_DRAINING: set[asyncio.Task] = set()    # feeds whose client left, reading to the job's end


class JobFeed:
    """A job's deltas, fetched ahead by a task; ``next(timeout)`` returns a Delta, ``None`` when
    nothing came within ``timeout``, or ``_END``; it raises what the stream raised."""

    def __init__(self, job: AsyncJob, segment_s: float = 5.0) -> None:
        self.job = job
        self.segment_s = segment_s
        self.abandoned = False
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.task = asyncio.create_task(self._pump(), name=f"feed-{job.id}")

    async def _pump(self) -> None:
        """Relay every delta, then ``_END`` (or the exception that ended the stream). Reads in
        segments of ``segment_s`` (a new ``stream()`` continues exactly where the last one
        stopped), so an abandoned feed of a job no worker ever ends stops within one."""
        try:
            while not self.abandoned:
                try:
                    async for delta in self.job.stream(timeout=self.segment_s):
                        self.queue.put_nowait(delta)
                except TimeoutError:
                    continue
                self.queue.put_nowait(_END)
                return
        except Exception as exc:  # relayed to the reader, which answers with it
            self.queue.put_nowait(exc)

    async def next(self, timeout: float) -> Any:
        try:
            item = await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None
        if isinstance(item, Exception):
            raise item
        return item

    async def close(self, cancel_job: bool) -> None:
        """Cancel the job when its client went away before it ended. Shielded: this runs while
        the request's task is being cancelled by the disconnect. The reading task is not
        cancelled mid-read (a cancelled read in the shared Redis pool can hang that task);
        it ends by itself at the job's terminal event, which a cancel brings within a step."""
        with anyio.CancelScope(shield=True):
            if cancel_job:
                try:
                    await self.job.cancel()
                except Exception:  # Redis gone: the job runs on; nothing more to do here
                    pass
        self.abandoned = True
        if not self.task.done():
            _DRAINING.add(self.task)
            self.task.add_done_callback(_DRAINING.discard)


@dataclass
class Choice:
    """What was relayed of one choice: its text so far and its logprob records."""

    text_len: int = 0
    parts: list[str] = field(default_factory=list)
    records: list[TokenLogprob] = field(default_factory=list)
    finish_reason: Optional[str] = None
    opened: bool = False            # chat: the role chunk was sent
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
        elif delta.text or lp or delta.finish_reason:
            c.finish_reason = delta.finish_reason
            out.append(chunk_choice(self.req.chat, delta.index, delta.text, lp,
                                    delta.finish_reason))
        return out

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
                out.append(chunk_choice(self.req.chat, o.index, None if self.req.chat else "",
                                        None, o.finish_reason))
        return out

    def chunk(self, choices: list[dict[str, Any]], usage: Any = ...) -> str:
        if usage is ... and self.req.include_usage:
            usage = None
        return sse(chunk_body(self.req.chat, self.job.id, self.created, self.model, choices,
                              usage))

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
            choices.append(choice_body(self.req.chat, o.index, o.text, lp, o.finish_reason))
        return completion_body(self.req.chat, self.job.id, self.created, self.model, choices,
                               usage_of(result))


def usage_of(result: Result) -> dict[str, int]:
    return usage_body(result.usage.prompt_tokens, result.usage.completion_tokens)


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


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


async def whole_response(answer: Answer, disconnected: Callable[[], Awaitable[bool]],
                         metrics: GatewayMetrics, poll_s: float = 0.5) -> Optional[dict]:
    """Wait for the job and build its body; None (and the job cancelled) when the client left."""
    feed = JobFeed(answer.job)
    ended = False
    checked = time.monotonic()
    try:
        while True:
            try:
                item = await feed.next(poll_s)
            except Exception as exc:
                ended = True
                raise api_error(exc) from None
            if item is _END:
                ended = True
                break
            if time.monotonic() - checked >= poll_s:    # every poll_s, however busy the job
                checked = time.monotonic()
                if await disconnected():
                    metrics.cancelled.inc()
                    return None
            if item is None:
                continue
            if not answer.choices:
                metrics.ttft.observe(time.monotonic() - answer.started)
            answer.add(item)
        result = finished_result(answer)
        _count(metrics, result)
        return answer.whole(result)
    finally:
        await feed.close(cancel_job=not ended)


async def first_item(feed: JobFeed, wait_s: float) -> Any:
    """The first delta, or None after ``wait_s``: an error that comes this early is still
    answered with its HTTP status (APIError), before any byte of the stream is sent."""
    try:
        return await feed.next(wait_s)
    except Exception as exc:
        await feed.close(cancel_job=False)
        raise api_error(exc) from None


async def event_stream(answer: Answer, feed: JobFeed, first: Any, keepalive_s: float,
                       metrics: GatewayMetrics) -> AsyncIterator[str]:
    """The SSE body: chunks as deltas come, keep-alive comments while none does, the closing
    chunks, the usage chunk when asked for, ``[DONE]``. A failure after the first byte is sent
    as an ``error`` event (what the openai client raises from). A client that leaves cancels
    the job (``feed.close``)."""
    ended = False
    try:
        item: Union[Delta, None, object] = first
        while item is not _END:
            if item is None:
                yield KEEPALIVE
            else:
                if not answer.choices:
                    metrics.ttft.observe(time.monotonic() - answer.started)
                for choice in answer.add(item):  # type: ignore[arg-type]
                    yield answer.chunk([choice])
            try:
                item = await feed.next(keepalive_s)
            except Exception as exc:
                ended = True
                raise api_error(exc) from None
        ended = True
        result = finished_result(answer)
        _count(metrics, result)
        for choice in answer.closing(result):
            yield answer.chunk([choice])
        if answer.req.include_usage:
            yield answer.chunk([], usage_of(result))
        yield DONE
    except APIError as err:
        yield sse(err.body())
        yield DONE
    finally:
        if not ended:
            metrics.cancelled.inc()
        await feed.close(cancel_job=not ended)
