"""Bulk batches in the OpenAI Batch file format, resumable and memory-bounded.

Input: JSONL lines ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions", "body": {...}}``. Output: one line per finished request, in completion order,
``{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}``;
failures (malformed lines with their line number, rejected or failed jobs) go to the errors file.

Why it is safe to kill and rerun: job ids are derived from the batch id and the custom_id, so a
rerun skips every custom_id already in the output or errors file and resubmits the rest with the
same ids; the enqueue script's dedupe turns those into reattachments to jobs still queued or
running (or finished but unread), never into second jobs.

Why memory stays bounded for a million lines: the input is streamed, at most ``concurrency`` jobs
are in flight, results are written as they finish, and the "already done" index holds 8 bytes per
finished custom_id (a sorted array, not a set of strings).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import time
from array import array
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional, TextIO

from pydantic import BaseModel, ConfigDict

from producer_sdk.client import Client, progress_bar
from producer_sdk.errors import InvalidRequest, JobFailed
from producer_sdk.job import Job, Result

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
DEFAULT_MODEL = "tokenrelay"
# OpenAI body fields that map onto SamplingParams one to one (vLLM extensions included).
_SAMPLING_PASSTHROUGH = ("temperature", "top_p", "seed", "stop", "presence_penalty",
                         "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens",
                         "stop_token_ids", "ignore_eos", "skip_special_tokens",
                         "include_stop_str_in_output")
# Accepted only with the value that means "the default behaviour".
_ONLY_DEFAULT = {"n": (1, None), "stream": (False, None), "stream_options": (None,),
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


class BatchRequest(BaseModel):
    """One input line (OpenAI Batch request object)."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class LineTag:
    """What the writer needs to know about a job once it finishes."""

    custom_id: str
    line: int
    url: str
    model: str
    logprobs: bool


@dataclass
class BatchSummary:
    batch_id: str
    total_lines: int = 0
    succeeded: int = 0
    failed: int = 0
    malformed: int = 0
    skipped: int = 0
    elapsed_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


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
    usage = {"prompt_tokens": result.usage.prompt_tokens,
             "completion_tokens": result.usage.completion_tokens,
             "total_tokens": result.usage.prompt_tokens + result.usage.completion_tokens}
    created = int(time.time())
    lp = _format_logprobs(tag, result) if tag.logprobs else None
    if tag.url == CHAT_URL:
        body = {"id": f"chatcmpl-{result.job_id}", "object": "chat.completion", "created": created,
                "model": tag.model, "choices": [{
                    "index": 0, "message": {"role": "assistant", "content": result.text},
                    "logprobs": lp, "finish_reason": result.finish_reason}], "usage": usage}
    else:
        body = {"id": f"cmpl-{result.job_id}", "object": "text_completion", "created": created,
                "model": tag.model, "choices": [{
                    "index": 0, "text": result.text, "logprobs": lp,
                    "finish_reason": result.finish_reason}], "usage": usage}
    return {"id": f"batch_req_{result.job_id}", "custom_id": tag.custom_id,
            "response": {"status_code": 200, "request_id": result.job_id, "body": body},
            "error": None}


def _format_logprobs(tag: LineTag, result: Result) -> Optional[dict[str, Any]]:
    """Logprobs by token id (the worker sends ids, not token strings)."""
    if not result.logprobs:
        return None
    pairs = list(zip(result.token_ids, result.logprobs))
    if tag.url == CHAT_URL:
        return {"content": [{"token_id": tid, "logprob": top.get(tid),
                             "top_logprobs": [{"token_id": k, "logprob": v}
                                              for k, v in top.items()]} for tid, top in pairs]}
    return {"tokens": [str(t) for t, _ in pairs],
            "token_logprobs": [top.get(t) for t, top in pairs],
            "top_logprobs": [{str(k): v for k, v in top.items()} for _, top in pairs]}


def error_line(custom_id: Optional[str], line: int, code: str, message: str,
               job_id: Optional[str] = None) -> dict[str, Any]:
    return {"id": f"batch_req_{job_id}" if job_id else None, "custom_id": custom_id,
            "line": line, "response": None, "error": {"code": code, "message": message}}


# --------------------------------------------------------------------------------------------
# Resume index
# --------------------------------------------------------------------------------------------

_SORT_RUN = 65536


def _digest(custom_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(custom_id.encode(), digest_size=8).digest(), "little")


class DoneIndex:
    """custom_ids already written (8 bytes each) plus line numbers of id-less malformed lines."""

    def __init__(self) -> None:
        self._ids = array("Q")
        self.lines: set[int] = set()

    def __contains__(self, custom_id: str) -> bool:
        d = _digest(custom_id)
        i = bisect_left(self._ids, d)
        return i < len(self._ids) and self._ids[i] == d

    def __len__(self) -> int:
        return len(self._ids)

    @classmethod
    def load(cls, *paths: Path) -> "DoneIndex":
        """Read earlier output/errors files, repairing a last line cut short by a kill."""
        idx = cls()
        runs: list[array] = []
        chunk: list[int] = []
        for path in paths:
            for obj in _read_complete_lines(path):
                cid = obj.get("custom_id")
                if isinstance(cid, str):
                    chunk.append(_digest(cid))
                    if len(chunk) >= _SORT_RUN:
                        runs.append(array("Q", sorted(chunk)))
                        chunk = []
                elif isinstance(obj.get("line"), int):
                    idx.lines.add(obj["line"])
        runs.append(array("Q", sorted(chunk)))
        # Sorted runs merged lazily: the peak stays near 16 bytes per id, not a list of ints.
        idx._ids = array("Q", heapq.merge(*runs))
        return idx


def _read_complete_lines(path: Path) -> Iterator[dict[str, Any]]:
    if not path.exists():
        return
    _truncate_partial_tail(path)
    with open(path, "rb") as f:
        for raw in f:
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            if isinstance(obj, dict):
                yield obj


def _truncate_partial_tail(path: Path) -> None:
    """Drop bytes after the last newline: a line the previous run was killed while writing."""
    size = path.stat().st_size
    if size == 0:
        return
    with open(path, "rb+") as f:
        pos = size
        while pos > 0:
            step = min(65536, pos)
            f.seek(pos - step)
            chunk = f.read(step)
            nl = chunk.rfind(b"\n")
            if nl >= 0:
                end = pos - step + nl + 1
                if end != size:
                    f.truncate(end)
                return
            pos -= step
        f.truncate(0)


def scan_input(path: Path) -> tuple[int, str]:
    """Line count (for the progress bar's ETA) and content hash (the default batch id)."""
    h = hashlib.sha256()
    lines = 0
    last = b"\n"
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            lines += chunk.count(b"\n")
            last = chunk[-1:]
    return lines + (0 if last == b"\n" else 1), h.hexdigest()


# --------------------------------------------------------------------------------------------
# Runner
# --------------------------------------------------------------------------------------------

class BatchRunner:
    """Runs one batch file through a Client; ``run()`` can be repeated after an interruption."""

    def __init__(self, client: Client, input_path: os.PathLike | str,
                 output_path: os.PathLike | str, errors_path: Optional[os.PathLike | str] = None,
                 *, batch_id: Optional[str] = None, concurrency: int = 256, priority: int = 1,
                 progress: bool = True, flush_every_s: float = 0.2) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.client = client
        self.input = Path(input_path)
        self.output = Path(output_path)
        self.errors = Path(errors_path) if errors_path else self.output.with_suffix(
            ".errors.jsonl")
        self.batch_id = batch_id
        self.concurrency = concurrency
        self.priority = priority
        self.progress = progress
        self.flush_every_s = flush_every_s
        # Digests of the custom_ids submitted in this run: OpenAI requires them unique, and two
        # lines with one id would map to one job and be answered twice.
        self._seen: set[int] = set()
        if not self.input.is_file():
            raise FileNotFoundError(f"batch input {self.input} does not exist")

    def run(self) -> BatchSummary:
        t0 = time.monotonic()
        total, digest = scan_input(self.input)
        batch_id = self.batch_id or f"batch_{digest[:24]}"
        summary = BatchSummary(batch_id=batch_id, total_lines=total)
        done = DoneIndex.load(self.output, self.errors)
        bar = progress_bar(total, self.progress, f"batch {batch_id[:20]}")
        with open(self.output, "a", encoding="utf-8") as out, \
                open(self.errors, "a", encoding="utf-8") as err:
            writer = _Writer(out, err, self.flush_every_s)
            try:
                source = self._source(batch_id, done, writer, summary, bar)
                for tag, job in self.client.iter_completed(
                        source, concurrency=self.concurrency, block=True, cancel_on_exit=False):
                    self._write_result(tag, job, writer, summary)
                    bar.update(1)
            finally:
                writer.flush()
                bar.close()
        summary.elapsed_s = time.monotonic() - t0
        return summary

    def _source(self, batch_id: str, done: DoneIndex, writer: "_Writer", summary: BatchSummary,
                bar: Any) -> Iterator[tuple[LineTag, Any]]:
        with open(self.input, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    bar.update(1)
                    continue
                item = self._line(raw, lineno, batch_id, done, writer, summary)
                if item is not None:
                    yield item
                else:
                    bar.update(1)
                writer.maybe_flush()

    def _line(self, raw: bytes, lineno: int, batch_id: str, done: DoneIndex, writer: "_Writer",
              summary: BatchSummary) -> Optional[tuple[LineTag, Any]]:
        """One input line as (tag, prepared job), or None when skipped or written as an error.
        Lines already answered are recognized before any validation: a rerun skips fast."""
        cid: Optional[str] = None
        try:
            obj = _load_line(raw, lineno)
            cid = obj.get("custom_id")
            cid = cid if isinstance(cid, str) and cid else None
            if cid is not None and cid in done:
                summary.skipped += 1
                return None
            if cid is not None and _digest(cid) in self._seen:
                raise LineError("duplicate_custom_id",
                                f"line {lineno} repeats custom_id {cid!r}; custom_ids must be unique")
            tag, kwargs = _parse(obj, lineno)
        except LineError as exc:
            # A duplicate's error is keyed by line, not id: the id is answered by its first line.
            key = None if exc.code == "duplicate_custom_id" else cid
            if key is None and lineno in done.lines:
                summary.skipped += 1
            else:
                writer.error(error_line(key, lineno, exc.code, exc.message))
                summary.malformed += 1
            return None
        job_id = job_id_for(batch_id, tag.custom_id)
        try:
            prepared = self.client.prepare(kwargs, job_id=job_id, priority=self.priority,
                                           stream=tag.logprobs)
        except InvalidRequest as exc:
            writer.error(error_line(tag.custom_id, lineno, "invalid_request", str(exc), job_id))
            summary.malformed += 1
            return None
        self._seen.add(_digest(tag.custom_id))
        return tag, prepared

    def _write_result(self, tag: LineTag, job: Job, writer: "_Writer",
                      summary: BatchSummary) -> None:
        try:
            result = job.state.result()
        except JobFailed as exc:
            writer.error(error_line(tag.custom_id, tag.line, exc.code, exc.message, job.id))
            summary.failed += 1
            return
        if result.finish_reason == "cancelled":
            writer.error(error_line(tag.custom_id, tag.line, "cancelled",
                                    "the job was cancelled before it finished", job.id))
            summary.failed += 1
            return
        writer.output(response_line(tag, result))
        summary.succeeded += 1


def _load_line(raw: bytes, lineno: int) -> dict[str, Any]:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise LineError("invalid_json", f"line {lineno} is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise LineError("invalid_request", f"line {lineno} is not a JSON object")
    return obj


def _parse(obj: dict[str, Any], lineno: int) -> tuple[LineTag, dict[str, Any]]:
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise LineError("invalid_request", "custom_id must be a non-empty string")
    req = _validated(obj)
    if req.method.upper() != "POST":
        raise LineError("invalid_request", f"method must be POST, got {req.method!r}")
    kwargs = body_to_request(req.url, req.body)
    model = req.body.get("model")
    tag = LineTag(cid, lineno, req.url, model if isinstance(model, str) else DEFAULT_MODEL,
                  kwargs.get("logprobs") is not None)
    return tag, kwargs


def _validated(obj: dict[str, Any]) -> BatchRequest:
    from pydantic import ValidationError
    try:
        return BatchRequest.model_validate(obj)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "line"
        raise LineError("invalid_request", f"{where}: {first.get('msg')}") from None


class _Writer:
    """Appends JSON lines; flushes at most every ``every_s`` so a kill loses little (and a rerun
    recovers what it lost from the result streams)."""

    def __init__(self, out: TextIO, err: TextIO, every_s: float) -> None:
        self.out, self.err = out, err
        self.every_s = every_s
        self._last = time.monotonic()

    def output(self, obj: dict[str, Any]) -> None:
        self.out.write(json.dumps(obj, ensure_ascii=False) + "\n")
        self.maybe_flush()

    def error(self, obj: dict[str, Any]) -> None:
        self.err.write(json.dumps(obj, ensure_ascii=False) + "\n")
        self.maybe_flush()

    def maybe_flush(self) -> None:
        if time.monotonic() - self._last >= self.every_s:
            self.flush()

    def flush(self) -> None:
        self.out.flush()
        self.err.flush()
        self._last = time.monotonic()
