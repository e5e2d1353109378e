"""``tokenrelay {submit,batch,stats,cancel,status,result}``: the SDK from a shell.

Every command takes ``--redis-url`` (one Redis, or any node of a Redis Cluster), ``--cluster``,
``--namespace``, ``--queue`` and ``--shards`` (before or after it); each option is also a
``TOKENRELAY_<NAME>`` variable (protocol/settings.py). Exit codes: one table,
``producer_sdk/cli/exit_codes.py`` (shown by ``--help`` and in the README).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional, Sequence

from pydantic import Field

from tokenrelay.protocol.settings import (BackPressureSettings, CliSettings, ConnectionSettings, JsonOutput,
                               add_settings_flags, own_env, parse_settings, unset)
from tokenrelay.producer_sdk.batch.lock import BatchLocked
from tokenrelay.producer_sdk.batch.cli import cmd_batch, cmd_batch_status, status_line
from tokenrelay.producer_sdk.client import Client
from tokenrelay.producer_sdk.cli.exit_codes import (EXIT_FAILED, EXIT_FINISHED, EXIT_FULL,
                                                EXIT_INVALID, EXIT_LOCKED, EXIT_NO_WORKER,
                                                EXIT_NOT_DURABLE, EXIT_TIMEOUT, EXIT_UNAVAILABLE,
                                                EXIT_UNKNOWN, exit_table)
from tokenrelay.producer_sdk.errors import (InvalidRequest, JobFailed, JobNotFound, ModelNotFound,
                                            NotDurable, QueueFull, RedisUnavailable)
from tokenrelay.producer_sdk.cli.stats import discover_queues, queue_stats, stats_table
from tokenrelay.producer_sdk.openai.structured import from_cli, rename_error
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.shards import ShardCountMismatch, registered_shards, resolve_shards
from tokenrelay.protocol.topology import cluster_flag
from tokenrelay.protocol.wire import PRODUCER_PATTERN

SERVER_DEFAULT = unset("the worker's")


class DurableOptions(CliSettings):
    """Durable submits: wait until replicas hold the jobs before reporting them enqueued."""

    durable: bool = Field(False, description="Wait until --durable-replicas replicas "
                          "acknowledged each enqueue (Redis WAIT); fewer: exit 7, jobs stay "
                          "enqueued.")
    durable_replicas: int = Field(1, ge=1, description="Replicas a durable submit waits for.")
    durable_timeout_ms: int = Field(1000, ge=1, description="Longest wait for them, in ms.")


class WaitOption(CliSettings):
    timeout: Optional[float] = Field(None, gt=0, description="Seconds to wait for the result.",
                                     json_schema_extra=unset("wait as long as it takes"))


class BatchIdOption(CliSettings):
    batch_id: Optional[str] = Field(None, description="The batch's id: names its jobs, so reruns "
                                    "with the same id resume.",
                                    json_schema_extra=unset("batch_<hash of the input file>"))


class ProducerOption(CliSettings):
    producer: Optional[str] = Field(None, pattern=PRODUCER_PATTERN, description="Who submits "
                                    "(the jobs' producer id): workers share their grammar "
                                    "compile threads fairly among producers.",
                                    json_schema_extra=unset("none: the anonymous producer"))


class SubmitOptions(ConnectionSettings, JsonOutput, WaitOption, DurableOptions,
                    BackPressureSettings, ProducerOption):
    """``submit``: sampling parameters the CLI passes on (unset: the server's defaults)."""

    model: Optional[str] = Field(None, description="The served model to ask (as the gateway's "
                                 "and batch's model): the job goes to the queue live workers "
                                 "serve it on (none: exit 8).",
                                 json_schema_extra=unset("whichever model serves --queue"),
                                 **own_env("submit", "model"))    # a worker's is a path
    chat: bool = Field(False, description="Send the prompt as one user chat message.")
    stream: bool = Field(False, description="Print tokens as they arrive.")
    max_tokens: Optional[int] = Field(None, description="Most tokens to generate.",
                                      json_schema_extra=SERVER_DEFAULT)
    temperature: Optional[float] = Field(None, description="Sampling temperature; 0 is greedy.",
                                         json_schema_extra=SERVER_DEFAULT)
    top_p: Optional[float] = Field(None, description="Nucleus sampling mass.",
                                   json_schema_extra=SERVER_DEFAULT)
    top_k: Optional[int] = Field(None, description="Sample from the k likeliest tokens.",
                                 json_schema_extra=SERVER_DEFAULT)
    seed: Optional[int] = Field(None, description="Sampling seed.",
                                json_schema_extra=unset("random"))
    stop: Optional[list[str]] = Field(None, description="Stop string.",
                                      json_schema_extra=unset("none"))
    n: Optional[int] = Field(None, description="Sampled choices; with more than one, each output "
                             "line starts with [choice].", json_schema_extra=SERVER_DEFAULT)
    beam_width: Optional[int] = Field(None, description="Beam search with this many beams (each "
                                      "printed, best first, as [rank] lines).",
                                      json_schema_extra=unset("sampling, no beam search"))
    length_penalty: Optional[float] = Field(None, description="Beam search length penalty.",
                                            json_schema_extra=SERVER_DEFAULT)
    priority: int = Field(0, description="Below 0: the urgent lane; above 0: the bulk lane.",
                          **own_env("submit", "priority"))
    job_id: Optional[str] = Field(None, description="The job's id (a resubmission is deduped).",
                                  json_schema_extra=unset("a fresh random id"))
    block: bool = Field(False, description="Wait for room when the queue is full.")
    wait_for_worker: bool = Field(False, description="Submit even when no live worker serves "
                                  "the queue, and wait for one (else: exit 8 at once).")
    routing_key: Optional[str] = Field(
        None, description="Prefix-affinity key (a conversation or system-prompt id): jobs with "
        "the same key go to the same live worker.", json_schema_extra=unset("none"))
    # Structured output: at most one (producer_sdk/openai/structured.py, docs/protocol.md).
    json_schema: Optional[str] = Field(None, description="Answer as JSON this schema validates "
                                       "(a file, or the schema itself).",
                                       json_schema_extra=unset("none"))
    json_object: bool = Field(False, description="Answer as a JSON object.")
    regex: Optional[str] = Field(None, description="Answer as a full match of this regex.",
                                 json_schema_extra=unset("none"))
    choice: Optional[list[str]] = Field(None, description="Answer with exactly one of these "
                                        "strings (repeat the flag).",
                                        json_schema_extra=unset("none"))
    grammar: Optional[str] = Field(None, description="Answer as a sentence of this Lark or GBNF "
                                   "grammar (a file, or the grammar itself).",
                                   json_schema_extra=unset("none"))


class BatchOptions(ConnectionSettings, BatchIdOption, DurableOptions, BackPressureSettings,
                   ProducerOption):
    errors: Optional[str] = Field(None, description="Errors JSONL.",
                                  json_schema_extra=unset("OUTPUT with .errors.jsonl"))
    concurrency: int = Field(256, ge=1, description="Most jobs in flight.")
    priority: int = Field(1, description="Job priority (1: the bulk lane).",
                          **own_env("batch", "priority"))
    progress: bool = Field(True, description="Show a progress bar.")
    allow_failures: bool = Field(False, description="Exit 0 even when lines failed or were "
                                 "malformed (else: exit 1 while the errors file holds any).")
    wait_log_s: float = Field(10.0, gt=0, description="Seconds between the lines that say a "
                              "queue the batch waits on has no live worker.")


class StatsOptions(ConnectionSettings, JsonOutput):
    queue: Optional[str] = Field(None, description="Queue to report.",   # type: ignore[assignment]
                                 json_schema_extra=unset("every queue of the namespace"))
    live_s: float = Field(10.0, gt=0, description="A worker is live if it beat within this many "
                          "seconds.")


class StatusOptions(ConnectionSettings, JsonOutput, BatchIdOption):
    batch: Optional[str] = Field(None, description="The batch input JSONL: one line per job, "
                                 "then the counts by state.", json_schema_extra=unset("none"))
    output: Optional[str] = Field(None, description="With --batch: the run's output JSONL, "
                                  "whose errors file (OUTPUT.errors.jsonl) is counted too.",
                                  json_schema_extra=unset("none"))
    errors: Optional[str] = Field(None, description="With --batch: the run's errors JSONL, "
                                  "counted by error code.",
                                  json_schema_extra=unset("OUTPUT with .errors.jsonl"))


class ResultOptions(ConnectionSettings, JsonOutput, WaitOption):
    pass


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenrelay",
                                     description="tokenrelay producer: submit jobs, run OpenAI-"
                                                 "format batch files, inspect queues.",
                                     epilog=exit_table(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_settings_flags(parser, ConnectionSettings)
    sub = parser.add_subparsers(dest="command", required=True)
    submit = sub.add_parser("submit", help="submit one prompt and print its output")
    submit.add_argument("prompt")
    add_settings_flags(submit, SubmitOptions)
    batch = sub.add_parser("batch", help="run an OpenAI Batch JSONL file (resumable; every "
                           "line needs body.model; a UTF-8 BOM is fine; one run per output "
                           "file at a time: a second one exits 9)")
    batch.add_argument("input", help="OpenAI Batch input JSONL")
    batch.add_argument("output", help="results JSONL (appended to; rerun to resume)")
    add_settings_flags(batch, BatchOptions)
    add_settings_flags(sub.add_parser("stats", help="queue depth, lag, pending, workers, dead "
                                                    "letters, lanes no worker reads"),
                       StatsOptions)
    cancel = sub.add_parser("cancel", help="cancel a job by id (exit 6, nothing written, when "
                                           "Redis holds no record of that id)")
    cancel.add_argument("job_id")
    add_settings_flags(cancel, ConnectionSettings)
    status = sub.add_parser("status", help="where a job stands (queued, running, done, ...), "
                                           "or every job of a batch (--batch INPUT: each "
                                           "custom_id once, malformed lines named)")
    status.add_argument("job_id", nargs="?")
    add_settings_flags(status, StatusOptions)
    result = sub.add_parser("result", help="wait for a job and print its output")
    result.add_argument("job_id")
    add_settings_flags(result, ResultOptions)
    for command in sub.choices.values():       # every command's --help ends with the table
        command.epilog, command.formatter_class = parser.epilog, parser.formatter_class
    return parser


# What a command's exception exits with, first match first: RedisUnavailable and TimeoutError
# are OSErrors (a missing batch input, output folder, ...), InvalidRequest a ValueError (e.g. a
# job id with spaces or braces).
EXITS: tuple[tuple[type[BaseException], int], ...] = (
    (RedisUnavailable, EXIT_UNAVAILABLE), (InvalidRequest, EXIT_INVALID), (QueueFull, EXIT_FULL),
    (JobFailed, EXIT_FAILED), (TimeoutError, EXIT_TIMEOUT), (JobNotFound, EXIT_UNKNOWN),
    (ModelNotFound, EXIT_NO_WORKER),
    (NotDurable, EXIT_NOT_DURABLE), (ShardCountMismatch, EXIT_INVALID),
    (BatchLocked, EXIT_LOCKED), (OSError, EXIT_INVALID),
    (ValueError, EXIT_INVALID))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args, opts = parse_settings(build_parser(), argv)
    try:
        return run_command(args, opts)
    except BrokenPipeError:         # the reader left: cli_common.run_cli ends quietly
        raise
    except tuple(kind for kind, _ in EXITS) as exc:
        what = "invalid request: " if isinstance(exc, InvalidRequest) else ""
        print(f"error: {what}{exc}", file=sys.stderr)
        return next(code for kind, code in EXITS if isinstance(exc, kind))


def run_command(args: argparse.Namespace, opts: Any) -> int:
    if args.command == "stats":
        return cmd_stats(opts)
    with Client(opts.redis_url, queue=opts.queue, namespace=opts.namespace,
                **client_settings(opts)) as client:
        if args.command == "submit":
            return cmd_submit(client, args, opts)
        if args.command == "batch":
            return cmd_batch(client, args, opts)
        if args.command == "status":
            return cmd_status(client, args, opts)
        if args.command == "result":
            return cmd_result(client, args, opts)
        return cmd_cancel(client, args.job_id)


def cmd_cancel(client: Client, job_id: str) -> int:
    """Cancel a job: 10 (nothing written) when it had already finished, 6 when unknown."""
    st = client.status(job_id)
    if st.finished:
        print(f"job {job_id} had already finished ({st.state}); nothing to cancel",
              file=sys.stderr)
        return EXIT_FINISHED
    client.cancel(job_id)
    print(f"cancel requested for {job_id}")
    return 0


def client_settings(opts: ConnectionSettings) -> dict[str, Any]:
    """The Client settings a command's options give: cluster mode, shard count and, for the
    commands that submit, the durable ones and the queue bounds."""
    out: dict[str, Any] = {"cluster": cluster_flag(opts.cluster), "shards": opts.shards}
    if isinstance(opts, BackPressureSettings):
        out.update(max_queued_jobs=opts.max_queued_jobs, max_queued_tokens=opts.max_queued_tokens)
    if isinstance(opts, ProducerOption):
        out["producer"] = opts.producer
    if isinstance(opts, DurableOptions):
        out.update(durable=opts.durable, durable_replicas=opts.durable_replicas,
                   durable_timeout_ms=opts.durable_timeout_ms,
                   socket_timeout_s=max(10.0, opts.durable_timeout_ms / 1000 + 1))
    return out


def cmd_submit(client: Client, args: argparse.Namespace, opts: SubmitOptions) -> int:
    sampling = {k: v for k, v in (("max_tokens", opts.max_tokens),
                                  ("temperature", opts.temperature), ("top_p", opts.top_p),
                                  ("top_k", opts.top_k), ("seed", opts.seed),
                                  ("stop", opts.stop), ("n", opts.n),
                                  ("beam_width", opts.beam_width),
                                  ("length_penalty", opts.length_penalty)) if v is not None}
    constraint = from_cli(opts.json_schema, opts.json_object, opts.regex, opts.choice,
                          opts.grammar)
    if constraint is not None:
        sampling["structured_outputs"] = constraint.spec
    source = {"messages": [{"role": "user", "content": args.prompt}]} if opts.chat else {
        "prompt": args.prompt}
    queue = model_queue(client, opts)
    try:
        prepared = client.prepare({**source, **sampling, "job_id": opts.job_id,
                                   "priority": opts.priority, "stream": opts.stream,
                                   "routing_key": opts.routing_key, "model": opts.model,
                                   "queue": None if queue == client.queue else queue})
    except InvalidRequest as exc:       # named as the flag that asked for the constraint
        raise rename_error(exc, constraint.param if constraint else None) from None
    if not opts.wait_for_worker and not client.live_workers(queue):
        print(f"error: no live worker serves queue {queue!r} (namespace "
              f"{client.namespace!r}); start one (tokenrelay worker --queue {queue} "
              f"--model ...) or pass --wait-for-worker", file=sys.stderr)
        return EXIT_NO_WORKER
    (job,) = client.enqueue([prepared], block=opts.block)
    print(f"job {job.id}", file=sys.stderr)
    several = (opts.n or 1) > 1 or opts.beam_width is not None
    try:
        if opts.stream:
            lines = ChoiceLines(sys.stdout) if several else None
            for delta in job.stream(timeout=opts.timeout):
                if lines is not None:
                    lines.feed(delta)
                else:
                    sys.stdout.write(delta.text)
                sys.stdout.flush()
            result = job.result(timeout=opts.timeout)
            if lines is not None:
                lines.close()
            else:
                sys.stdout.write("\n")
        else:
            result = job.result(timeout=opts.timeout)
            if opts.json:
                print(result.model_dump_json())
            elif several:
                lines = ChoiceLines(sys.stdout)
                for out in result.outputs:
                    lines.write(out.index, out.text)
            else:
                print(result.text)
    except KeyboardInterrupt:
        job.cancel()
        print(f"\ncancelled {job.id}", file=sys.stderr)
        return 130
    print(f"finish_reason={result.finish_reason} tokens={result.usage.completion_tokens}",
          file=sys.stderr)
    return 0


def model_queue(client: Client, opts: SubmitOptions) -> str:
    """The queue a submit goes to: the one live workers serve ``--model`` on (ModelNotFound,
    exit 8, when none does: with ``--wait-for-worker``, ``--queue``, where the worker that
    comes checks the model), else ``--queue``."""
    if opts.model is None:
        return client.queue
    try:
        return client.queue_of_model(opts.model)
    except ModelNotFound:
        if opts.wait_for_worker:
            return client.queue
        raise


class ChoiceLines:
    """Prints several choices as lines that each start with ``[choice] ``: streamed tokens of
    different choices interleave, so each choice's text is held until it completes a line (or
    the choice finishes) and printed whole."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.held: dict[int, str] = {}

    def feed(self, delta: Any) -> None:
        text = self.held.pop(delta.index, "") + delta.text
        *lines, rest = text.split("\n")
        for line in lines:
            self.out.write(f"[{delta.index}] {line}\n")
        if rest and delta.finish_reason is not None:
            self.write(delta.index, rest)
        elif rest:
            self.held[delta.index] = rest

    def write(self, index: int, text: str) -> None:
        for line in text.split("\n"):
            self.out.write(f"[{index}] {line}\n")

    def close(self) -> None:
        for index in sorted(self.held):
            self.write(index, self.held[index])
        self.held.clear()


def cmd_status(client: Client, args: argparse.Namespace, opts: StatusOptions) -> int:
    """Exit 0 for a known job, 6 for an unknown id."""
    if opts.batch is not None:
        return cmd_batch_status(client, opts)
    if args.job_id is None:
        raise InvalidRequest("status needs a JOB_ID or --batch INPUT")
    st = client.status(args.job_id)
    print(st.model_dump_json() if opts.json else status_line(st.job_id, st))
    if st.state == "unknown":
        print(f"error: {JobNotFound(args.job_id, client.queue, client.namespace)}",
              file=sys.stderr)
        return EXIT_UNKNOWN
    return 0


def cmd_result(client: Client, args: argparse.Namespace, opts: ResultOptions) -> int:
    result = client.get(args.job_id).result(timeout=opts.timeout)
    print(result.model_dump_json() if opts.json else result.text)
    return 0


# --------------------------------------------------------------------------------------------
# stats
# --------------------------------------------------------------------------------------------

def cmd_stats(opts: StatsOptions) -> int:
    import redis
    from tokenrelay.producer_sdk.core.client_core import NET_ERRORS, make_redis
    from tokenrelay.producer_sdk.config import ClientConfig
    from tokenrelay.protocol.topology import redact_url
    url = opts.redis_url
    try:
        r = make_redis(ClientConfig(redis_url=url, cluster=cluster_flag(opts.cluster)))
    except NET_ERRORS as exc:
        raise RedisUnavailable(redact_url(url), exc) from exc
    try:
        queues = [opts.queue] if opts.queue else discover_queues(r, opts.namespace)
        stats = [queue_stats(r, stats_keys(r, opts, q), opts.live_s) for q in queues]
    except NET_ERRORS as exc:
        raise RedisUnavailable(redact_url(url), exc) from exc
    except redis.ResponseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        r.close()
    if opts.json:
        print(json.dumps(stats, indent=2))
    else:
        print(stats_table(stats, opts.namespace))
    return 0


def stats_keys(r: Any, opts: StatsOptions, queue: str) -> Keys:
    """A queue's keys for stats: its registered shard count (``--shards`` must match it when
    given for the ``--queue`` asked for)."""
    keys = Keys(opts.namespace, queue)
    given = opts.shards if queue == opts.queue else None
    return keys.with_queue(queue, resolve_shards(given, registered_shards(r, keys), keys))
