"""The OpenAI side of bulk batches: request bodies to submit() arguments, results to lines.

Kept apart from the runner (``batch.py``) because it is pure format mapping: what the OpenAI
Batch API accepts and returns for ``/v1/chat/completions`` and ``/v1/completions``, and which of
its fields tokenrelay supports. Nothing here does I/O.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Any, Optional

from producer_sdk.job import CompletionOutput, Result
from producer_sdk.logprobs import TokenLogprob

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
DEFAULT_MODEL = "tokenrelay"
# OpenAI body fields that map onto SamplingParams one to one (vLLM extensions included).
_SAMPLING_PASSTHROUGH = ("n", "temperature", "top_p", "seed", "stop", "presence_penalty",
                         "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens",
                         "stop_token_ids", "ignore_eos", "skip_special_tokens",
                         "include_stop_str_in_output")
# Accepted only with the value that means "the default behaviour".
_ONLY_DEFAULT = {"stream": (False, None), "stream_options": (None,),
                 "echo": (False, None), "best_of": (1, None), "suffix": (None, ""),
                 "logit_bias": (None, {}), "parallel_tool_calls": (None,),
                 "tools": (None, []), "tool_choice": (None, "none"),
                 "response_format": (None, {"type": "text"})}
_IGNORED = ("model", "user", "service_tier", "store")


class LineError(Exception):
    """One input line that cannot become a job; goes to the errors file with ``code``."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class LineTag:
    """What the writer needs to know about a job once it finishes."""

    custom_id: str
    line: int
    url: str
    model: str
    logprobs: bool
    top_logprobs: int = 0        # alternatives per token asked for (chat top_logprobs, or logprobs)


# --------------------------------------------------------------------------------------------
# OpenAI body -> submit() arguments
# --------------------------------------------------------------------------------------------

def body_to_request(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Map an OpenAI request body onto submit() keyword arguments; LineError if unsupported."""
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise LineError("invalid_url", f"url must be {CHAT_URL} or {COMPLETIONS_URL}, got {url!r}")
    body = dict(body)
    req: dict[str, Any] = {}
    if url == CHAT_URL:
        req["messages"] = _messages(body.pop("messages", None))
    else:
        req.update(_prompt(body.pop("prompt", None)))
    _max_tokens(body, req)
    _logprobs(url, body, req)
    for name in _SAMPLING_PASSTHROUGH:
        if name in body:
            value = body.pop(name)
            if value is not None:
                req[name] = value
    meta = body.pop("metadata", None)
    if meta is not None:
        if not isinstance(meta, dict):
            raise LineError("invalid_request", "body.metadata must be an object")
        req["metadata"] = meta
    template_vars = body.pop("chat_template_kwargs", None)      # vLLM's extension
    if template_vars is not None:
        if url != CHAT_URL or not isinstance(template_vars, dict):
            raise LineError("invalid_request", "body.chat_template_kwargs must be an object, "
                                               f"on {CHAT_URL} only")
        req["chat_template_kwargs"] = template_vars
    for name, allowed in _ONLY_DEFAULT.items():
        if name in body and body.pop(name) not in allowed:
            raise LineError("unsupported_field",
                            f"body.{name} is only supported as {allowed[0]!r}")
    for name in _IGNORED:
        body.pop(name, None)
    if body:
        raise LineError("unsupported_field", f"unsupported body field(s): {', '.join(sorted(body))}")
    return req


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise LineError("invalid_request", "body.messages must be a non-empty array")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise LineError("invalid_request", f"body.messages[{i}] needs a string role")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise LineError("unsupported_field", f"body.messages[{i}].content: only "
                                    f"text parts are supported")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        if not isinstance(content, str):
            raise LineError("invalid_request", f"body.messages[{i}].content must be a string")
        msg = {"role": m["role"], "content": content}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _prompt(prompt: Any) -> dict[str, Any]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a one-element batch of prompts is one prompt
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return {"prompt_token_ids": prompt}
    raise LineError("invalid_request", "body.prompt must be a string, a list of token ids, or a "
                    "one-element list of either (one prompt per line)")


def _max_tokens(body: dict[str, Any], req: dict[str, Any]) -> None:
    a, b = body.pop("max_tokens", None), body.pop("max_completion_tokens", None)
    if a is not None and b is not None and a != b:
        raise LineError("invalid_request", "max_tokens and max_completion_tokens disagree")
    value = b if b is not None else a
    if value is not None:
        req["max_tokens"] = value


def _logprobs(url: str, body: dict[str, Any], req: dict[str, Any]) -> None:
    lp, top = body.pop("logprobs", None), body.pop("top_logprobs", None)
    if url == CHAT_URL:
        if lp not in (None, False, True):
            raise LineError("invalid_request", "body.logprobs must be a boolean for chat")
        if top is not None and not lp:
            raise LineError("invalid_request", "body.top_logprobs requires logprobs: true")
        if lp:
            req["logprobs"] = top or 0
    else:
        if top is not None:
            raise LineError("unsupported_field", "body.top_logprobs is a chat field; use logprobs")
        if lp is not None:
            req["logprobs"] = lp


# --------------------------------------------------------------------------------------------
# Output lines
# --------------------------------------------------------------------------------------------

def job_id_for(batch_id: str, custom_id: str) -> str:
    """Deterministic, protocol-safe job id: the same line of the same batch is the same job."""
    return "b-" + hashlib.sha256(f"{batch_id}\0{custom_id}".encode()).hexdigest()[:40]


def response_line(tag: LineTag, result: Result) -> dict[str, Any]:
    """The OpenAI-shaped output line: one choice per output (``n`` of them), each with its
    index, message (chat) or text, logprobs and finish_reason; usage sums every choice."""
    usage = {"prompt_tokens": result.usage.prompt_tokens,
             "completion_tokens": result.usage.completion_tokens,
             "total_tokens": result.usage.total_tokens}
    created = int(time.time())
    choices = [_choice(tag, out) for out in result.outputs]
    if tag.url == CHAT_URL:
        body = {"id": f"chatcmpl-{result.job_id}", "object": "chat.completion", "created": created,
                "model": tag.model, "choices": choices, "usage": usage}
    else:
        body = {"id": f"cmpl-{result.job_id}", "object": "text_completion", "created": created,
                "model": tag.model, "choices": choices, "usage": usage}
    return {"id": f"batch_req_{result.job_id}", "custom_id": tag.custom_id,
            "response": {"status_code": 200, "request_id": result.job_id, "body": body},
            "error": None}


def _choice(tag: LineTag, out: CompletionOutput) -> dict[str, Any]:
    lp = _format_logprobs(tag, out) if tag.logprobs else None
    if tag.url == CHAT_URL:
        return {"index": out.index, "message": {"role": "assistant", "content": out.text},
                "logprobs": lp, "finish_reason": out.finish_reason}
    return {"index": out.index, "text": out.text, "logprobs": lp,
            "finish_reason": out.finish_reason}


def _format_logprobs(tag: LineTag, out: CompletionOutput) -> Optional[dict[str, Any]]:
    if not out.token_logprobs:
        return None
    return openai_logprobs(tag.url, out.token_logprobs, tag.top_logprobs)


def openai_logprobs(url: str, tokens: list[TokenLogprob], top: int) -> dict[str, Any]:
    """A choice's logprobs in OpenAI's shape: chat ``{"content": [ChatCompletionTokenLogprob]}``,
    completions ``Logprobs`` (``text_offset`` counts the tokens' decoded characters). ``top``
    alternatives per token: the SDK's ``top_logprobs`` also hold the chosen token when it is
    not among the best ``top``, and OpenAI's do not, so they are cut at ``top``."""
    if url == CHAT_URL:
        return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes),
                             "top_logprobs": [{"token": a.token, "logprob": a.logprob,
                                               "bytes": list(a.bytes)}
                                              for a in t.top_logprobs[:top]]}
                            for t in tokens], "refusal": None}
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t.token)
    return {"tokens": [t.token for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{a.token: a.logprob for a in t.top_logprobs[:top]} for t in tokens],
            "text_offset": offsets}


def error_line(custom_id: Optional[str], line: int, code: str, message: str,
               job_id: Optional[str] = None) -> dict[str, Any]:
    return {"id": f"batch_req_{job_id}" if job_id else None, "custom_id": custom_id,
            "line": line, "response": None, "error": {"code": code, "message": message}}
