"""``POST /tokenize`` and ``POST /detokenize``, as vLLM's OpenAI server serves them.

The gateway holds no tokenizer (no torch, no model files, no chat template), so each call is
answered by a live worker of the model's queue from its own tokenizer, through Redis
(``protocol/tokenize.py``: one call entry, one reply stream). What it answers is therefore what
a job of that model would be tokenized to: ``count`` is that job's ``usage.prompt_tokens``.
The bodies are vLLM's (``TokenizeCompletionRequest``, ``TokenizeChatRequest``,
``DetokenizeRequest``), checked strictly here; the model is routed as ``/v1/completions``
routes it (404 unknown, 503 no live worker), and a call no worker answers within
``--tokenize-timeout-s`` is a 504.
"""

from __future__ import annotations

import secrets
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from redis.exceptions import RedisError

from tokenrelay.producer_sdk.gateway.backend import Gateway
from tokenrelay.producer_sdk.gateway.errors import APIError, api_error
from tokenrelay.producer_sdk.openai.format import LineError, parse_messages
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.tokenize import (CALLS_MAXLEN, TokenizeAnswer, TokenizeCall, pack,
                                          unpack)

TOKENIZE_URL = "/tokenize"          # both in guard.TOKEN_URLS: authenticated and counted there
DETOKENIZE_URL = "/detokenize"


class TokenizeBody(BaseModel):
    """vLLM's tokenize request: a ``prompt`` (completions) or chat ``messages``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[Any]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeBody":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.prompt is not None and self.chat_template_kwargs is not None:
            raise ValueError("chat_template_kwargs applies to messages only")
        if not self.add_generation_prompt:
            raise ValueError("add_generation_prompt: only true is supported (a chat job's "
                             "prompt always ends with the generation prompt)")
        return self


class DetokenizeBody(BaseModel):
    """vLLM's detokenize request."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: Optional[str] = None
    tokens: list[int] = Field(max_length=1_000_000)


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


def parse_body(cls: type[BaseModel], body: Any) -> Any:
    """The body as ``cls``, or a 400 naming the first field it gets wrong."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", "invalid_request_error",
                       None, "invalid_request")
    try:
        return cls.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ())) or None
        msg = err.get("msg", "invalid").removeprefix("Value error, ")
        code = "unsupported_field" if err.get("type") == "extra_forbidden" else "invalid_request"
        raise APIError(400, f"{loc + ': ' if loc else ''}{msg}", "invalid_request_error",
                       loc, code) from None


def tokenize_call(body: TokenizeBody) -> TokenizeCall:
    """The call a worker answers (chat messages checked and normalized as chat jobs are)."""
    call: dict[str, Any] = {"id": secrets.token_hex(16), "kind": "tokenize",
                            "add_special_tokens": body.add_special_tokens}
    if body.messages is not None:
        try:
            call["messages"] = parse_messages(body.messages)
        except LineError as exc:
            raise APIError(400, exc.message, "invalid_request_error", exc.param,
                           "invalid_request") from None
        call["chat_template_kwargs"] = body.chat_template_kwargs
    else:
        call["prompt"] = body.prompt
    return TokenizeCall.model_validate(call)


def detokenize_call(body: DetokenizeBody) -> TokenizeCall:
    return TokenizeCall(id=secrets.token_hex(16), kind="detokenize", tokens=body.tokens)


async def ask_worker(gw: Gateway, model: Optional[str], call: TokenizeCall) -> TokenizeAnswer:
    """Send ``call`` to the model's queue and wait for a worker's answer (504 after
    ``--tokenize-timeout-s``); a refusal is the worker's 400, naming the field."""
    await gw.ready()
    try:
        queue = await gw.queue_of(model, wait=False)
        keys = Keys(gw.s.namespace, queue)
        reply = keys.tokenize_reply(call.id)
        async with gw.tokenize_slots:
            await gw.redis.xadd(keys.tokenize_calls, pack(call), maxlen=CALLS_MAXLEN,
                                approximate=True)
            got = await gw.redis.xread({reply: "0"}, count=1,
                                       block=max(1, int(gw.s.tokenize_timeout_s * 1000)))
    except RedisError as exc:
        raise api_error(exc, gw.s.retry_after_s) from None
    if not got:
        raise APIError(504, f"no worker of model {model!r} (queue {queue!r}) answered the "
                       f"{call.kind} call within {gw.s.tokenize_timeout_s:g} s "
                       f"(--tokenize-timeout-s); workers older than this gateway do not answer "
                       f"it", "timeout_error", None, "timeout")
    answer = unpack(got[0][1][0][1], TokenizeAnswer)
    if answer.error is not None:
        raise APIError(400, answer.error.message, "invalid_request_error", answer.error.param,
                       answer.error.code)
    return answer


async def tokenize(gw: Gateway, body: Any) -> dict[str, Any]:
    req = parse_body(TokenizeBody, body)
    answer = await ask_worker(gw, req.model, tokenize_call(req))
    return TokenizeResponse(tokens=answer.tokens or [], count=answer.count or 0,
                            max_model_len=answer.max_model_len or 0).model_dump()


async def detokenize(gw: Gateway, body: Any) -> dict[str, Any]:
    req = parse_body(DetokenizeBody, body)
    answer = await ask_worker(gw, req.model, detokenize_call(req))
    return DetokenizeResponse(prompt=answer.prompt or "").model_dump()


__all__ = ["TOKENIZE_URL", "DETOKENIZE_URL", "tokenize", "detokenize"]
