"""Bulk batches in the OpenAI Batch file format, resumable and memory-bounded.

Input: JSONL lines ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions", "body": {"model", ...}}`` (UTF-8, a leading BOM accepted; ``body.model``
required, as OpenAI requires it). Output: one line per finished request, in completion order,
``{"id", "custom_id", "response": {"status_code": 200, "request_id", "body"}, "error": null}``;
failures (malformed lines, rejected or failed jobs) go to the errors file as OpenAI writes them:
``"response": null`` and ``"error"`` a ``BatchError`` (code, line, message, param). One run per
output file at a time (``batch_lock``).

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Optional, TextIO

from pydantic import BaseModel, ConfigDict

from tokenrelay.producer_sdk.client import Client
from tokenrelay.producer_sdk.core.window import progress_bar
from tokenrelay.producer_sdk.errors import InvalidRequest, JobFailed, ModelNotFound
from tokenrelay.producer_sdk.jobs.job import Job
from tokenrelay.producer_sdk.core.models import ModelCache, resolve_model
from tokenrelay.producer_sdk.batch.watch import DEFAULT_EVERY_S, WorkerWatch
from tokenrelay.producer_sdk.batch.lines import (LineTag, error_counts, error_line,
                                                 error_line_number, job_id_for, response_line)
from tokenrelay.producer_sdk.batch.lock import OutputLock
from tokenrelay.producer_sdk.openai.format import LineError, parse_request
from tokenrelay.producer_sdk.openai.structured import fit_tools, rename_error
from tokenrelay.protocol.keys import Keys

class BatchRequest(BaseModel):
    """One input line (OpenAI Batch request object)."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str
    method: str
    url: str
    body: dict[str, Any]


@dataclass
class BatchSummary:
    batch_id: str
    total_lines: int = 0
    succeeded: int = 0
    failed: int = 0
    malformed: int = 0
    skipped: int = 0
    elapsed_s: float = 0.0
    errors_file_lines: int = 0      # every line of the errors file, this run's and earlier ones'

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


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
                elif (line := error_line_number(obj)) is not None:
                    idx.lines.add(line)
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
                 progress: bool = True, flush_every_s: float = 0.2,
                 durable: Optional[bool] = None, wait_log_s: float = DEFAULT_EVERY_S) -> None:
        """``wait_log_s``: how often a line says that a queue the batch waits on has no live
        worker (producer_sdk/batch/watch.py)."""
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
        self.durable = durable      # None: the client's default (ClientConfig.durable)
        self.router = ModelRouter(client)
        self.watch = WorkerWatch(client, wait_log_s)
        # Digests of the custom_ids submitted in this run: OpenAI requires them unique, and two
        # lines with one id would map to one job and be answered twice.
        self._seen: set[int] = set()
        if not self.input.is_file():
            raise FileNotFoundError(f"batch input {self.input} does not exist")
        for path in (self.output, self.errors):
            if not path.parent.is_dir():
                raise FileNotFoundError(f"the folder of {path} does not exist; create it first")

    def run(self) -> BatchSummary:
        """Run (or resume) the batch; BatchLocked when another run writes the output now."""
        with OutputLock(self.output):
            return self._run()

    def _run(self) -> BatchSummary:
        t0 = time.monotonic()
        total, digest = scan_input(self.input)
        batch_id = self.batch_id or f"batch_{digest[:24]}"
        summary = BatchSummary(batch_id=batch_id, total_lines=total)
        done = DoneIndex.load(self.output, self.errors)
        bar = progress_bar(total, self.progress, f"batch {batch_id[:20]}")
        with open(self.output, "a", encoding="utf-8") as out, \
                open(self.errors, "a", encoding="utf-8") as err, self.watch:
            writer = _Writer(out, err, self.flush_every_s)
            try:
                source = self._source(batch_id, done, writer, summary, bar)
                for tag, job in self.client.iter_completed(
                        source, concurrency=self.concurrency, block=True, cancel_on_exit=False,
                        durable=self.durable):
                    self._write_result(tag, job, writer, summary)
                    bar.update(1)
            finally:
                writer.flush()
                bar.close()
        summary.elapsed_s = time.monotonic() - t0
        summary.errors_file_lines = sum(error_counts(self.errors).values())
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
            obj = load_line(raw, lineno)
            cid = obj.get("custom_id")
            cid = cid if isinstance(cid, str) and cid else None
            if cid is not None and cid in done:
                summary.skipped += 1
                return None
            if cid is not None and _digest(cid) in self._seen:
                raise LineError("duplicate_custom_id",
                                f"line {lineno} repeats custom_id {cid!r}; custom_ids must be unique")
            tag, kwargs = parse_line(obj, lineno)
        except LineError as exc:
            # A duplicate's error is keyed by line, not id: the id is answered by its first line.
            key = None if exc.code == "duplicate_custom_id" else cid
            if key is None and lineno in done.lines:
                summary.skipped += 1
            else:
                writer.error(error_line(key, lineno, exc.code, exc.message, param=exc.param))
                summary.malformed += 1
            return None
        job_id = job_id_for(batch_id, tag.custom_id)
        try:
            queue, served = self.router.route(tag.model)
        except LineError as exc:
            writer.error(model_not_found_line(tag.custom_id, lineno, exc.message, job_id))
            summary.failed += 1
            return None
        tag = replace(tag, model=served)
        self.watch.sent(served, queue)
        try:
            if tag.tools is not None:       # tools as the served model's template takes them
                kwargs = fit_tools(kwargs, tag.tools, *self.router.tool_format(served))
            # stream=False: the done event carries the output, logprobs and their tokens too
            prepared = self.client.prepare(kwargs, job_id=job_id, priority=self.priority,
                                           stream=False, queue=queue, model=served)
        except (InvalidRequest, LineError) as exc:
            msg = exc.message if isinstance(exc, LineError) else str(
                rename_error(exc, tag.constraint_param))
            writer.error(error_line(tag.custom_id, lineno, "invalid_request", msg, job_id))
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


def load_line(raw: bytes, lineno: int) -> dict[str, Any]:
    try:
        obj = json.loads(raw.decode("utf-8-sig"))     # a BOM (line 1) is not JSON
    except (UnicodeDecodeError, ValueError) as exc:
        raise LineError("invalid_json", f"line {lineno} is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise LineError("invalid_request", f"line {lineno} is not a JSON object")
    return obj


def parse_line(obj: dict[str, Any], lineno: int) -> tuple[LineTag, dict[str, Any]]:
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        raise LineError("invalid_request", "custom_id must be a non-empty string")
    req = _validated(obj)
    if req.method.upper() != "POST":
        raise LineError("invalid_request", f"method must be POST, got {req.method!r}")
    parsed = parse_request(req.url, req.body, streaming=False)
    kwargs = parsed.kwargs
    model = req.body.get("model")
    if not isinstance(model, str) or not model:
        raise LineError("invalid_request", "body.model is required (a non-empty string, as "
                        "OpenAI requires): it names the model whose workers run the line",
                        "model")
    tag = LineTag(cid, lineno, req.url, model, kwargs.get("logprobs") is not None,
                  kwargs.get("logprobs") or 0, parsed.tools, parsed.constraint_param,
                  parsed.echo)
    return tag, kwargs


class ModelRouter:
    """The queue a line's ``body.model`` goes to, and the model name its output shows.

    * a model that live workers serve (``producer_sdk.core.models``): the queue they serve it on,
      and the output's ``model`` is that served name;
    * a model no live worker serves: ``model_not_found`` (the line goes to the errors file) --
      unless no live worker of the namespace advertises any model and the namespace has no
      queue but the runner's: then the line waits on that queue for workers to come (a batch
      may be queued before any worker starts, as before models were routed), and the output
      echoes the model asked for.

    The listing is read at most every ``ttl_s`` seconds (``ModelCache``), so a batch follows
    workers that come and go without a Redis read per line."""

    def __init__(self, client: Client, ttl_s: float = 2.0) -> None:
        self.client = client
        self.queue = client.queue
        self.models = ModelCache(client.redis, client.namespace, ttl_s)
        self._only_queue: Optional[tuple[float, bool]] = None
        self.ttl_s = ttl_s

    def route(self, model: str) -> tuple[Optional[str], str]:
        """(queue for ``prepare``, None for the runner's; the output's model); LineError
        ``model_not_found`` when no live worker serves ``model``."""
        models = self.models.get()
        if not models and self._single_queue():
            return None, model
        try:
            found = resolve_model(models, model)
        except ModelNotFound as exc:
            raise LineError("model_not_found", str(exc), "model") from None
        return (None if found.queue == self.queue else found.queue), model

    def tool_format(self, model: str) -> tuple[Optional[str], str, bool]:
        """(what the model's chat template does with tools, the model, whether a live worker
        said so): the arguments ``structured.fit_tools`` takes after the plan."""
        served = self.models.get().get(model)
        return (served.tool_format, model, True) if served else (None, model, False)

    def _single_queue(self) -> bool:
        now = time.monotonic()
        if self._only_queue is None or now >= self._only_queue[0]:
            names = {q.decode() if isinstance(q, bytes) else q
                     for q in self.client.redis.smembers(Keys(self.client.namespace).queues)}
            self._only_queue = (now + self.ttl_s, names <= {self.queue})
        return self._only_queue[1]


def model_not_found_line(custom_id: str, line: int, message: str, job_id: str) -> dict[str, Any]:
    """The errors-file line of a request for a model nobody serves, as OpenAI's Batch API
    writes a failed request: its HTTP status and error object (``code`` model_not_found)."""
    out = error_line(custom_id, line, "model_not_found", message, job_id)
    out["response"] = {"status_code": 404, "request_id": None, "body": {"error": {
        "message": message, "type": "invalid_request_error", "param": "model",
        "code": "model_not_found"}}}
    return out


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
