"""Result events: what a worker writes to a job's result stream, one msgpack map per entry.

Part of the wire contract (``decode_event`` lives in ``protocol.wire``). Models allow unknown fields: changes to v1 are
additive, and readers ignore what they do not know.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

import msgpack
from pydantic import BaseModel, ConfigDict, Field, computed_field, model_validator


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


# token id -> (its text, its raw bytes) for every id a ``logprobs`` list names: what OpenAI's
# logprobs show (``token``, ``bytes``) and a producer cannot compute without the tokenizer.
LogprobTokens = dict[int, tuple[str, bytes]]


class TokenEvent(_Event):
    """New tokens of one choice in one engine step. ``seq`` numbers the token events of a job
    0, 1, 2, ... across all its choices; ``choice`` is the choice they belong to (sample i of
    ``n``, or the beam's rank) and ``position`` the output position, within that choice, of the
    first token in ``token_ids``. A choice's last token event carries its ``finish_reason``
    (and ``stop_reason``, ``cumulative_logprob``): a worker taking the job over then knows that
    choice is done and does not run it again.

    With ``logprobs`` (only when the job asked for them) comes ``logprob_tokens``: the text and
    bytes of every token id those maps name (``protocol.fold.token_logprobs`` joins them).

    v1 writers before choices named the position ``index``; it is read as ``position``."""

    type: Literal["token"] = "token"
    seq: int
    choice: int = Field(default=0, ge=0)
    position: int
    text: str
    token_ids: list[int]
    logprobs: Optional[list[dict[int, float]]] = None
    logprob_tokens: Optional[LogprobTokens] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[str, int]] = None
    cumulative_logprob: Optional[float] = None
    ts: float = Field(default_factory=time.time)

    @model_validator(mode="before")
    @classmethod
    def _legacy_index(cls, data: Any) -> Any:
        if isinstance(data, dict) and "position" not in data and "index" in data:
            data = {**data, "position": data["index"]}
            del data["index"]
        return data


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


class DoneChoice(BaseModel):
    """One choice's end, in the ``done`` event of a job with several (``n > 1`` or beam
    search): why it finished, its token count and, for ``stream=False`` jobs, its output."""

    model_config = ConfigDict(extra="allow")

    index: int = Field(ge=0)
    finish_reason: str
    stop_reason: Optional[Union[str, int]] = None
    completion_tokens: int = 0
    cumulative_logprob: Optional[float] = None
    text: Optional[str] = None
    token_ids: Optional[list[int]] = None
    logprobs: Optional[list[dict[int, float]]] = None      # stream=False jobs that asked
    logprob_tokens: Optional[LogprobTokens] = None


class DoneEvent(_Event):
    """Terminal success (or cancellation). For ``stream=False`` jobs it carries the whole output.
    ``finish_reason``, ``stop_reason``, ``text`` and ``token_ids`` are those of choice 0;
    ``choices`` (jobs with several) has every choice, and ``usage.completion_tokens`` is their
    sum, as OpenAI counts it. A ``stream=False`` job that asked for logprobs has them here
    (``logprobs`` and ``logprob_tokens``, as token events carry them; per choice in ``choices``)."""

    type: Literal["done"] = "done"
    finish_reason: str
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    metadata: dict[str, Any] = Field(default_factory=dict)
    text: Optional[str] = None
    token_ids: Optional[list[int]] = None
    logprobs: Optional[list[dict[int, float]]] = None      # stream=False jobs that asked
    logprob_tokens: Optional[LogprobTokens] = None
    stop_reason: Optional[Union[str, int]] = None
    choices: Optional[list[DoneChoice]] = None
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
