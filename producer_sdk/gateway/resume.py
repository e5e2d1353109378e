"""Resumable SSE streams: event ids, the resume record, and the grace a client that left gets.

Why: a client whose connection drops mid-stream (a mobile network, a proxy's idle cut, a
deploy of the load balancer) used to lose its completion and its job: the gateway cancelled
the job at once. Now every event carries an ``id:`` naming the job and the event's place in
the job's output, and a client that reconnects with ``Last-Event-ID`` (the same POST, as SSE
clients retry, or ``GET /v1/streams/<job id>``) gets exactly the events after it, from any
gateway replica: nothing repeated, nothing missed. A client that does not come back within
``--resume-grace-s`` has its job cancelled, as before.

The place is not a result-stream entry id: the rendering is a function of the fold's deltas
(``protocol/fold.py``), and a delta's identity is its token event's ``seq``, which survives a
worker takeover (retried or re-emitted entries are skipped by ``seq``) and a job Redis lost
and a reader enqueued again (a new stream, new entry ids, the same ``seq``). An id is
``<job id>:<t>:<k>``: ``t`` is the number of token events folded when the event was rendered
(the delta's ``seq`` + 1, 0 before the first), ``k`` the event's rank among those rendered at
that ``t`` (the role chunk and the text chunk of one delta; the closing chunks, usage chunk
and ``[DONE]`` after the last). Ids therefore grow strictly along a stream, and a resumed
stream renders every event again from the start of the result stream, sending only those
whose id is past ``Last-Event-ID``: same chunk ids, ``created``, model, indices, tool-call and
logprob state.

Who holds a stream, and the grace, are ``stream_records.py``'s.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from typing import Any, NamedTuple, Optional

from pydantic import BaseModel, ConfigDict, Field

from tokenrelay.producer_sdk.gateway.errors import APIError
from tokenrelay.producer_sdk.openai.format import CHAT_URL
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.scripts.cancel import CancelTarget, cancel_target

LAST_EVENT_ID = "last-event-id"
STREAMS_URL = "/v1/streams"
_EVENT_ID = re.compile(r"^(gw-[0-9a-f]{32}):(\d{1,9}):(\d{1,6})$")
_JOB_ID = re.compile(r"^gw-[0-9a-f]{32}$")


class EventId(NamedTuple):
    """An SSE event's id: the job, token events folded (``t``), rank at that count (``k``)."""

    job_id: str
    t: int
    k: int

    def text(self) -> str:
        return f"{self.job_id}:{self.t}:{self.k}"

    @property
    def place(self) -> tuple[int, int]:
        return self.t, self.k


def bad_event_id(raw: str, why: str) -> APIError:
    return APIError(400, f"Last-Event-ID {raw[:120]!r} {why}; send the id of the last event "
                    f"received (its 'id:' line, '<job id>:<n>:<n>'), or none to start a new "
                    f"request", "invalid_request_error", "Last-Event-ID", "invalid_last_event_id")


def parse_event_id(raw: str) -> EventId:
    """The id a client sent back; APIError 400 naming the header for anything else."""
    m = _EVENT_ID.match(raw.strip())
    if m is None:
        raise bad_event_id(raw, "is not an event id of this gateway")
    return EventId(m.group(1), int(m.group(2)), int(m.group(3)))


def check_job_id(job_id: str) -> str:
    """A job id of the gateway's shape (``gw-`` and 32 hex); 404 otherwise."""
    if not _JOB_ID.match(job_id):
        raise APIError(404, f"no resumable stream {job_id[:80]!r}: stream ids are the X-Job-Id "
                       f"of a streamed request ('gw-' and 32 hex digits)",
                       "invalid_request_error", None, "stream_not_found")
    return job_id


class Marks:
    """Stamps each rendered event with its id; past ``after`` only (a resume), the others are
    rendered for their state and not sent. ``reached`` once the stream got past ``after``;
    ``last`` is the id of the job's last event the client has (None before the first)."""

    def __init__(self, job_id: str, after: Optional[EventId] = None) -> None:
        self.job_id = job_id
        self.after = after
        self.t = 0
        self.k = 0
        self.reached = after is None
        self.last: Optional[str] = None

    def delta(self, seq: int) -> None:
        """A new delta: its events are counted at ``seq + 1``. Before the resume point the
        result stream must hold every token event (``seq`` contiguous from 0, as workers
        write it), else the state rebuilt from it would not be the one the client saw."""
        if not self.reached and seq != self.t:
            raise APIError(410, f"the result stream of job {self.job_id} no longer holds the "
                           f"events before Last-Event-ID (token event {seq} follows "
                           f"{self.t - 1}: trimmed or expired); send the request again "
                           f"without Last-Event-ID", "invalid_request_error", "Last-Event-ID",
                           "stream_gone")
        self.t, self.k = seq + 1, 0

    def stamp(self) -> Optional[str]:
        """The next event's id, or None when the client already has that event. APIError 400
        when the stream passes the resume point without an event of exactly that id."""
        place = (self.t, self.k)
        self.k += 1
        if self.reached:
            self.last = EventId(self.job_id, *place).text()
            return self.last
        assert self.after is not None
        if place < self.after.place:
            return None
        if place == self.after.place:
            self.reached = True
            self.last = self.after.text()
            return None
        raise bad_event_id(self.after.text(), "names no event of this stream")


def sse_event(event_id: Optional[str], data: str) -> str:
    """One SSE event: its ``id:`` line (when it has one), its ``data:`` line."""
    return f"id: {event_id}\ndata: {data}\n\n" if event_id else f"data: {data}\n\n"


class StreamSpec(BaseModel):
    """What rendering a job's stream takes besides its result stream, written when the stream
    starts and read by whichever gateway resumes it: the request body without its prompt (the
    shape of the answer: chat or not, logprobs, tools, usage), the response's ``created`` and
    model, and where the job's keys are."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    body: dict[str, Any]
    created: int
    model: str
    queue: str
    shards: int = Field(ge=1)
    shard: int = Field(ge=0)
    ends_ms: Optional[int] = None       # the request's total time, as epoch ms
    deadline_ms: Optional[int] = None   # the job's start deadline, which its readers keep

    def cancel_target(self, namespace: str, job_id: str) -> CancelTarget:
        return cancel_target(Keys(namespace, self.queue, self.shards), job_id, self.shard)

    def ends_at(self) -> Optional[float]:
        """The request's total time as a monotonic deadline of this process."""
        if self.ends_ms is None:
            return None
        return time.monotonic() + (self.ends_ms - time.time() * 1000) / 1000


def render_body(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The body without what rendering does not read and may be large (the prompt, the
    messages, the metadata): a one-character stand-in keeps it parseable."""
    out = {k: v for k, v in body.items() if k not in ("prompt", "messages", "metadata")}
    if url == CHAT_URL:
        out["messages"] = [{"role": "user", "content": "-"}]
    else:
        out["prompt"] = "-"
    return out


def body_digest(body: Any) -> str:
    """Of the body as parsed (key order and spacing do not matter): a POST resume must resend
    the request that started the job."""
    raw = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(raw.encode()).hexdigest()


def owner_digest(api_key: Optional[str]) -> str:
    """Who may resume: the digest of the API key that started the job ('-' with auth off: any
    caller). The key itself is never stored."""
    return "-" if api_key is None else hashlib.sha256(api_key.encode()).hexdigest()


__all__ = ["EventId", "LAST_EVENT_ID", "Marks", "STREAMS_URL", "StreamSpec", "bad_event_id",
           "body_digest", "check_job_id", "owner_digest", "parse_event_id", "render_body",
           "sse_event"]
