"""The OpenAI Batch file's output lines: what the batch runner writes for a finished job (the
response body built from the OpenAI shapes of ``openai/format.py``, tool calls read back by
``tool_calls.py``) or for a line that failed, and the job id each line gets."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any, Optional

from tokenrelay.producer_sdk.jobs.job import CompletionOutput, Result
from tokenrelay.producer_sdk.openai.format import (CHAT_URL, choice_body, completion_body, logprobs_body,
                                        token_logprobs_of, usage_body)
from tokenrelay.producer_sdk.openai.tool_calls import whole_choice


@dataclass(frozen=True, slots=True)
class LineTag:
    """What the writer needs to know about a job once it finishes."""

    custom_id: str
    line: int
    url: str
    model: str
    logprobs: bool
    top_logprobs: int = 0        # alternatives per token asked for (chat top_logprobs, or logprobs)
    tools: Any = None            # producer_sdk.openai.structured.ToolPlan: the answer may hold calls
    constraint_param: Optional[str] = None   # the body field that asked for a constraint
    echo: Optional[str] = None   # completions with echo: the prompt each choice's text starts with



def job_id_for(batch_id: str, custom_id: str) -> str:
    """Deterministic, protocol-safe job id: the same line of the same batch is the same job."""
    return "b-" + hashlib.sha256(f"{batch_id}\0{custom_id}".encode()).hexdigest()[:40]


def response_line(tag: LineTag, result: Result) -> dict[str, Any]:
    """The OpenAI-shaped output line: one choice per output (``n`` of them), each with its
    index, message (chat) or text, logprobs (``tag.top_logprobs`` alternatives) and
    finish_reason; usage sums every choice."""
    chat = tag.url == CHAT_URL
    choices = [_choice(chat, tag, out, tag.top_logprobs, result.job_id)
               for out in result.outputs]
    body = completion_body(chat, result.job_id, int(time.time()), tag.model, choices,
                           usage_body(result.usage.prompt_tokens, result.usage.completion_tokens))
    return {"id": f"batch_req_{result.job_id}", "custom_id": tag.custom_id,
            "response": {"status_code": 200, "request_id": result.job_id, "body": body},
            "error": None}


def _choice(chat: bool, tag: LineTag, out: CompletionOutput, top: int,
            job_id: str) -> dict[str, Any]:
    records = token_logprobs_of(out) if tag.logprobs else []
    lp = logprobs_body(chat, records, top) if records else None
    if tag.tools is not None:
        return whole_choice(tag.tools, job_id, out.index, out.text, lp, out.finish_reason)
    return choice_body(chat, out.index, (tag.echo or "") + out.text, lp, out.finish_reason)


def error_line(custom_id: Optional[str], line: int, code: str, message: str,
               job_id: Optional[str] = None, param: Optional[str] = None) -> dict[str, Any]:
    """An errors-file line in OpenAI's Batch shape: the request output object (``id``,
    ``custom_id``, ``response`` None, ``error``) whose ``error`` is OpenAI's ``BatchError``
    (``code``, ``line``: the input line, ``message``, ``param``: the body field to blame)."""
    return {"id": f"batch_req_{job_id}" if job_id else None, "custom_id": custom_id,
            "response": None,
            "error": {"code": code, "line": line, "message": message, "param": param}}


def error_counts(path: Any) -> dict[str, int]:
    """Lines of an errors file by ``error.code`` (a missing file: none), read without changing
    it (a last line cut short by a kill is left out): what a batch's exit code and ``status
    --batch`` count."""
    counts: dict[str, int] = {}
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        return counts
    with f:
        for raw in f:
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            err = obj.get("error") if isinstance(obj, dict) else None
            code = err.get("code") if isinstance(err, dict) else None
            key = code if isinstance(code, str) else "unknown"
            counts[key] = counts.get(key, 0) + 1
    return counts


def error_line_number(obj: dict[str, Any]) -> Optional[int]:
    """The input line an errors-file line names (``error.line``; top-level ``line`` in files
    written before the errors were OpenAI-shaped)."""
    err = obj.get("error")
    line = err.get("line") if isinstance(err, dict) else None
    line = obj.get("line") if line is None else line
    return line if isinstance(line, int) else None
