"""Result events: what a worker writes to a job's result stream, one msgpack map per entry.

Part of the wire contract (``producer_sdk.protocol`` re-exports every name here; ``decode_event``
lives there because it raises ProtocolError). Models allow unknown fields: changes to v1 are
additive, and readers ignore what they do not know.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

import msgpack
from pydantic import BaseModel, ConfigDict, Field, computed_field


class _Event(BaseModel):
    model_config = ConfigDict(extra="allow")


class StartedEvent(_Event):
    """Written when a worker starts (or resumes) a job. Records the sampling seed it uses, so any
    later resume samples exactly as the first worker would have."""

    type: Literal["started"] = "started"
    worker_id: str
    attempt: int = 1
    seed: Optional[int] = None
    resumed_tokens: int = 0
    ts: float = Field(default_factory=time.time)


class TokenEvent(_Event):
    """New tokens of one engine step. ``seq`` numbers token events 0, 1, 2, ... per job;
    ``index`` is the output position of the first token in ``token_ids``."""

    type: Literal["token"] = "token"
    seq: int
    index: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[dict[int, float]]] = None
    ts: float = Field(default_factory=time.time)


class Usage(BaseModel):
    """Token counts, named as OpenAI and vLLM name them; ``total_tokens`` is derived (also for
    events from workers that did not write it)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0

    @computed_field  # type: ignore[prop-decorator]
    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class Timings(BaseModel):
    queued_ms: Optional[float] = None
    ttft_ms: Optional[float] = None
    total_ms: Optional[float] = None


class DoneEvent(_Event):
    """Terminal success (or cancellation). For ``stream=False`` jobs it carries the whole output."""

    type: Literal["done"] = "done"
    finish_reason: str
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    metadata: dict[str, Any] = Field(default_factory=dict)
    text: Optional[str] = None
    token_ids: Optional[list[int]] = None
    stop_reason: Optional[Union[str, int]] = None
    ts: float = Field(default_factory=time.time)


class ErrorEvent(_Event):
    """Terminal failure: ``code`` from ErrorCode, ``message`` for a person."""

    type: Literal["error"] = "error"
    code: str
    message: str
    metadata: dict[str, Any] = Field(default_factory=dict)
    ts: float = Field(default_factory=time.time)


Event = Union[StartedEvent, TokenEvent, DoneEvent, ErrorEvent]
TERMINAL_TYPES = frozenset({"done", "error"})
EVENT_TYPES: dict[str, type[_Event]] = {
    "started": StartedEvent, "token": TokenEvent, "done": DoneEvent, "error": ErrorEvent}


def encode_event(event: _Event) -> bytes:
    return msgpack.packb(event.model_dump(exclude_none=True), use_bin_type=True)


def is_terminal(event: Event) -> bool:
    return event.type in TERMINAL_TYPES
