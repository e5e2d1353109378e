"""Tokenize and detokenize calls: how the gateway's ``/tokenize`` and ``/detokenize`` get their
answers from a worker of the model's queue.

Why through a worker: a prompt's tokens are what the worker's tokenizer makes of it, and a chat
request's are those of the checkpoint's chat template rendered the way the worker renders a chat
job (``worker/admission.py``). The gateway holds no torch, no model files and no template, so
it asks a live worker of the queue instead of guessing: the ``count`` it answers is the job's
``usage.prompt_tokens``, for any model, the fake engine's included.

The exchange (docs/protocol.md, "Tokenize calls"): the caller ``XADD``s a ``TokenizeCall``
(msgpack, field ``data``) to ``Keys.tokenize_calls`` (capped by ``MAXLEN ~``); one worker of the
queue reads it in the ``workers`` group, writes one ``TokenizeAnswer`` to the call's ``reply``
stream (``Keys.tokenize_reply``) with a TTL of ``REPLY_TTL_MS``, then acks and deletes the call.
The caller blocks on the reply stream for at most its own timeout; a call nobody answered in
time is the caller's 504, and its entry is trimmed away with the stream.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

import msgpack
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tokenrelay.protocol.keys import PAYLOAD_FIELD
from tokenrelay.protocol.wire import ChatMessage

TOKENIZE_VERSION = 1
# A reply stream lives this long after its answer is written: a caller that timed out leaves
# nothing behind for longer.
REPLY_TTL_MS = 60_000
# The calls stream is capped (XADD MAXLEN ~): calls no worker read are dropped, oldest first.
CALLS_MAXLEN = 10_000


class TokenizeCall(BaseModel):
    """One call: ``tokenize`` a ``prompt`` or chat ``messages``, or ``detokenize`` ``tokens``.

    ``add_special_tokens`` None means "as a job of this kind is tokenized": the tokenizer's
    default for a prompt, none for messages (the rendered template holds them), vLLM's
    defaults too."""

    model_config = ConfigDict(extra="forbid", strict=True)

    v: Literal[1] = TOKENIZE_VERSION
    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    kind: Literal["tokenize", "detokenize"]
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: Optional[bool] = None
    tokens: Optional[list[int]] = None

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeCall":
        given = [f for f in ("prompt", "messages", "tokens") if getattr(self, f) is not None]
        want = ["tokens"] if self.kind == "detokenize" else ["prompt", "messages"]
        if len(given) != 1 or given[0] not in want:
            raise ValueError(f"a {self.kind} call takes exactly one of {' or '.join(want)}; "
                             f"got {given or 'none'}")
        return self


class TokenizeError(BaseModel):
    """Why a call was refused: OpenAI-style ``code``, a message naming the field, the field."""

    code: str
    message: str
    param: Optional[str] = None


class TokenizeAnswer(BaseModel):
    """The worker's answer: ``tokens``/``count``/``max_model_len`` for tokenize, ``prompt``
    for detokenize, or ``error``."""

    model_config = ConfigDict(extra="ignore")

    tokens: Optional[list[int]] = None
    count: Optional[int] = None
    max_model_len: Optional[int] = None
    prompt: Optional[str] = None
    error: Optional[TokenizeError] = None


def pack(model: BaseModel) -> dict[bytes, bytes]:
    """A call or an answer as a stream entry's fields."""
    return {PAYLOAD_FIELD: msgpack.packb(model.model_dump(exclude_none=True), use_bin_type=True)}


def unpack(fields: dict, cls: type[BaseModel]) -> Any:
    """A stream entry back into ``cls`` (pydantic's ValidationError, or ValueError when the
    entry holds no msgpack map)."""
    raw = fields.get(PAYLOAD_FIELD, fields.get(PAYLOAD_FIELD.decode()))
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ValueError(f"not msgpack ({type(exc).__name__})") from None
    return cls.model_validate(obj)
