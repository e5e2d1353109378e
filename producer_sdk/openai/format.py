"""OpenAI's request and response shapes, for ``/v1/chat/completions`` and ``/v1/completions``.

The one home of those shapes: the batch runner (``batch.py``, OpenAI Batch files) and the HTTP
gateway (``producer_sdk.gateway``) both map request bodies with ``parse_request`` and build every
response body, streamed chunk, logprobs object (``openai/logprobs.py``) and error object here,
so a field OpenAI spells one way is never spelled two ways by us. Structured-output and tool
fields are mapped by ``structured.py``, tool calls read back by ``tool_calls.py``, batch output
lines built by ``batch/lines.py``. ``tests/gateway`` validates what these functions build
against the ``openai`` package's own types. Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from tokenrelay.producer_sdk.errors import LineError  # noqa: F401 (home: errors.py; imported from here too)
# The logprobs objects live beside these shapes (openai/logprobs.py) and are re-exported here.
from tokenrelay.producer_sdk.openai.logprobs import (TOKEN_ID_PREFIX, chat_logprobs,  # noqa: F401
                                          completion_logprobs, logprobs_body,
                                          token_logprobs_from_ids, token_logprobs_of)
from tokenrelay.producer_sdk.openai.structured import pop_openai
from tokenrelay.protocol.tools import template_tool_calls
from tokenrelay.protocol.wire import MAX_ROUTING_KEY_LEN

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
# OpenAI body fields that map onto SamplingParams one to one (vLLM extensions included).
_SAMPLING_PASSTHROUGH = ("n", "temperature", "top_p", "seed", "stop", "presence_penalty",
                         "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens",
                         "stop_token_ids", "ignore_eos", "skip_special_tokens",
                         "include_stop_str_in_output", "logit_bias")
# Accepted only with the value that means "the default behaviour".
_ONLY_DEFAULT = {"echo": (False, None), "best_of": (1, None), "suffix": (None, "")}
# Streaming fields: a batch line cannot stream, so there they too only take their defaults.
_STREAM_DEFAULTS = {"stream": (False, None), "stream_options": (None,)}
_IGNORED = ("model", "user", "service_tier", "store")
# The chat roles OpenAI's API knows; any other is refused (400) rather than handed to a chat
# template that would render it as text.
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    """One parsed request body: the submit() arguments and what shapes the response."""

    url: str
    kwargs: dict[str, Any]          # submit() keyword arguments (input, sampling, template vars)
    model: Optional[str]
    stream: bool
    include_usage: bool             # stream_options.include_usage
    user: Optional[str]
    tools: Any = None               # producer_sdk.openai.structured.ToolPlan when tools are given
    constraint_param: Optional[str] = None   # the field that asked for a constraint
    echo: Optional[str] = None      # completions with echo: the prompt each choice's text starts with

    @property
    def chat(self) -> bool:
        return self.url == CHAT_URL

    @property
    def logprobs(self) -> bool:
        return self.kwargs.get("logprobs") is not None

    @property
    def n(self) -> int:
        n = self.kwargs.get("n", 1)
        return n if type(n) is int and n > 0 else 1


# --------------------------------------------------------------------------------------------
# OpenAI body -> submit() arguments
# --------------------------------------------------------------------------------------------

def body_to_request(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The submit() arguments of a batch line's body (no streaming); LineError if unsupported."""
    return parse_request(url, body, streaming=False).kwargs


def parse_request(url: str, body: Any, *, streaming: bool) -> OpenAIRequest:
    """Map an OpenAI request body onto submit() arguments; LineError naming the field for what
    tokenrelay cannot do. Sampling values are not range-checked here: the SDK validates them
    with the wire schema (``sampling_params.py``) and names the field itself."""
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise LineError("invalid_url", f"url must be {CHAT_URL} or {COMPLETIONS_URL}, got {url!r}")
    if not isinstance(body, dict):
        raise LineError("invalid_request", "the request body must be a JSON object")
    body = dict(body)
    req: dict[str, Any] = {}
    if url == CHAT_URL:
        req["messages"] = _messages(body.pop("messages", None))
    else:
        req.update(_prompt(body.pop("prompt", None)))
    _max_tokens(body, req)
    _logprobs(url, body, req)
    echo = _echo(url, body, req)
    for name in _SAMPLING_PASSTHROUGH:
        value = body.pop(name, None)
        if value is not None:
            req[name] = value
    _metadata(body, req)
    _template_kwargs(url, body, req)
    _routing_key(body, req)
    constraint, plan, tools = pop_openai(url == CHAT_URL, body)  # response_format, tools, ...
    if constraint is not None:
        req["structured_outputs"] = constraint.spec
    if tools:
        req["tools"] = tools
    stream, include_usage = _stream(body) if streaming else (False, False)
    model, user = body.get("model"), body.get("user")
    if model is not None and not isinstance(model, str):
        raise LineError("invalid_request", "model must be a string", "model")
    if user is not None and not isinstance(user, str):
        raise LineError("invalid_request", "user must be a string", "user")
    _only_defaults(body, {**_ONLY_DEFAULT, **({} if streaming else _STREAM_DEFAULTS)})
    for name in _IGNORED:
        body.pop(name, None)
    if body:
        raise LineError("unsupported_field", f"unsupported body field(s): {', '.join(sorted(body))}",
                        sorted(body)[0])
    return OpenAIRequest(url, req, model, stream, include_usage, user, plan,
                         constraint.param if constraint is not None else None, echo)


def _echo(url: str, body: dict[str, Any], req: dict[str, Any]) -> Optional[str]:
    """Completions' ``echo``: the prompt text the answer's text starts with, or None.

    OpenAI's echo with logprobs also scores the prompt's tokens; our engine computes no
    prompt logprobs, so that pair is refused rather than answered without them. A prompt of
    token ids has no text here (the gateway holds no tokenizer), so it cannot be echoed."""
    if url != COMPLETIONS_URL or "echo" not in body:
        return None         # chat: echo stays in _ONLY_DEFAULT
    echo = body.pop("echo")
    if echo is None or echo is False:
        return None
    if echo is not True:
        raise LineError("invalid_request", "echo must be a boolean", "echo")
    if req.get("logprobs") is not None:
        raise LineError("unsupported_field", "echo with logprobs needs the prompt's logprobs, "
                        "which this engine does not compute; ask for echo or logprobs, not "
                        "both", "echo")
    if "prompt" not in req:
        raise LineError("unsupported_field", "echo needs the prompt as text: a prompt of token "
                        "ids cannot be echoed (send the text, or POST /detokenize it first)",
                        "echo")
    return req["prompt"]


def _only_defaults(body: dict[str, Any], allowed: dict[str, tuple]) -> None:
    for name, values in allowed.items():
        if name in body and body.pop(name) not in values:
            raise LineError("unsupported_field", f"{name} is only supported as {values[0]!r}",
                            name)


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream, options = body.pop("stream", None), body.pop("stream_options", None)
    if stream is not None and type(stream) is not bool:
        raise LineError("invalid_request", "stream must be a boolean", "stream")
    if options is None:
        return bool(stream), False
    if not stream:
        raise LineError("invalid_request", "stream_options is only allowed with stream: true",
                        "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise LineError("invalid_request", "stream_options must be an object with include_usage",
                        "stream_options")
    usage = options.get("include_usage", False)
    if type(usage) is not bool:
        raise LineError("invalid_request", "stream_options.include_usage must be a boolean",
                        "stream_options.include_usage")
    return True, usage


def _metadata(body: dict[str, Any], req: dict[str, Any]) -> None:
    meta = body.pop("metadata", None)
    if meta is not None:
        if not isinstance(meta, dict):
            raise LineError("invalid_request", "metadata must be an object", "metadata")
        req["metadata"] = meta


def _routing_key(body: dict[str, Any], req: dict[str, Any]) -> None:
    """OpenAI's ``prompt_cache_key`` is the job's routing key (prefix affinity: requests with
    the same key go to the worker whose prefix cache holds their common start). ``user`` is
    never used for it: one user's requests need not share a prefix, and it stays metadata."""
    key = body.pop("prompt_cache_key", None)
    if key is not None:
        if not isinstance(key, str) or not 0 < len(key) <= MAX_ROUTING_KEY_LEN:
            raise LineError("invalid_request", f"prompt_cache_key must be a string of 1-"
                            f"{MAX_ROUTING_KEY_LEN} characters", "prompt_cache_key")
        req["routing_key"] = key


def _template_kwargs(url: str, body: dict[str, Any], req: dict[str, Any]) -> None:
    template_vars = body.pop("chat_template_kwargs", None)      # vLLM's extension
    if template_vars is not None:
        if url != CHAT_URL or not isinstance(template_vars, dict):
            raise LineError("invalid_request", "chat_template_kwargs must be an object, "
                                               f"on {CHAT_URL} only", "chat_template_kwargs")
        req["chat_template_kwargs"] = template_vars


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages checked and normalized as a chat request's are (the gateway's
    ``/tokenize`` takes them too); LineError naming the field."""
    return _messages(messages)


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise LineError("invalid_request", "messages must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise LineError("invalid_request", f"messages[{i}] needs a string role",
                            f"messages[{i}].role")
        if m["role"] not in CHAT_ROLES:
            raise LineError("invalid_request", f"messages[{i}].role {m['role']!r:.40} is not "
                            f"one of {', '.join(sorted(CHAT_ROLES))}", f"messages[{i}].role")
        content = m.get("content")
        if content is None and m.get("tool_calls"):
            content = ""                 # an assistant turn that only called tools
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise LineError("unsupported_field", f"messages[{i}].content: only "
                                    f"text parts are supported", f"messages[{i}].content")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        if not isinstance(content, str):
            raise LineError("invalid_request", f"messages[{i}].content must be a string",
                            f"messages[{i}].content")
        msg = {"role": m["role"], "content": content}
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        if m.get("tool_calls"):
            try:
                msg["tool_calls"] = template_tool_calls(m["tool_calls"])
            except ValueError as exc:
                raise LineError("invalid_request", f"messages[{i}].{exc}",
                                f"messages[{i}].tool_calls") from None
        out.append(msg)
    return out


def _prompt(prompt: Any) -> dict[str, Any]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a one-element batch of prompts is one prompt
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return {"prompt_token_ids": prompt}
    raise LineError("invalid_request", "prompt must be a string, a list of token ids, or a "
                    "one-element list of either (one prompt per request)", "prompt")


def _max_tokens(body: dict[str, Any], req: dict[str, Any]) -> None:
    a, b = body.pop("max_tokens", None), body.pop("max_completion_tokens", None)
    if a is not None and b is not None and a != b:
        raise LineError("invalid_request", "max_tokens and max_completion_tokens disagree",
                        "max_completion_tokens")
    value = b if b is not None else a
    if value is not None:
        req["max_tokens"] = value


def _logprobs(url: str, body: dict[str, Any], req: dict[str, Any]) -> None:
    lp, top = body.pop("logprobs", None), body.pop("top_logprobs", None)
    if url == CHAT_URL:
        if lp is not None and type(lp) is not bool:
            raise LineError("invalid_request", "logprobs must be a boolean for chat", "logprobs")
        if top is not None and not lp:
            raise LineError("invalid_request", "top_logprobs requires logprobs: true",
                            "top_logprobs")
        if lp:
            req["logprobs"] = top or 0
    else:
        if top is not None:
            raise LineError("unsupported_field", "top_logprobs is a chat field; use logprobs",
                            "top_logprobs")
        if lp is not None:
            req["logprobs"] = lp


# --------------------------------------------------------------------------------------------
# Response bodies, chunks and errors
# --------------------------------------------------------------------------------------------

def response_id(chat: bool, job_id: str) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{job_id}"


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def choice_body(chat: bool, index: int, text: Optional[str], logprobs: Optional[dict[str, Any]],
                finish_reason: Optional[str],
                tool_calls: Optional[list[dict[str, Any]]] = None) -> dict[str, Any]:
    """One choice of a whole (non-streamed) response; chat's message may carry ``tool_calls``
    (producer_sdk/openai/tool_calls.py builds them)."""
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_body(chat: bool, job_id: str, created: int, model: str,
                    choices: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
    """A ``ChatCompletion`` or ``Completion``."""
    return {"id": response_id(chat, job_id),
            "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage}


def chunk_choice(chat: bool, index: int, text: Optional[str],
                 logprobs: Optional[dict[str, Any]], finish_reason: Optional[str],
                 role: bool = False,
                 tool_calls: Optional[list[dict[str, Any]]] = None) -> dict[str, Any]:
    """One choice of a streamed chunk: chat's ``delta`` (the role on a choice's first chunk,
    tool-call deltas when given) or a completion's ``text``."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return {"index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish_reason}
    return {"index": index, "text": text or "", "logprobs": logprobs,
            "finish_reason": finish_reason}


def chunk_body(chat: bool, job_id: str, created: int, model: str,
               choices: list[dict[str, Any]], usage: Any = ...) -> dict[str, Any]:
    """A ``ChatCompletionChunk`` or streamed ``Completion``; ``usage`` is left out unless given
    (``None`` on every chunk but the last when the client asked for include_usage)."""
    body: dict[str, Any] = {"id": response_id(chat, job_id),
                            "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": created, "model": model, "choices": choices}
    if usage is not ...:
        body["usage"] = usage
    return body


def error_body(message: str, type_: str, param: Optional[str] = None,
               code: Optional[str] = None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def model_body(name: str, created: int, owned_by: str = "tokenrelay") -> dict[str, Any]:
    """One ``Model`` of ``GET /v1/models``."""
    return {"id": name, "object": "model", "created": created, "owned_by": owned_by}
