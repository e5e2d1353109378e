"""``python -m producer_sdk {submit,batch,stats,cancel,status,result}``: the SDK from a shell.

Every command takes ``--redis-url`` (default ``$TOKENRELAY_REDIS_URL``), ``--namespace`` and
``--queue``. Exit codes: 0 ok, 1 job failed, 2 bad request, 3 Redis unreachable, 4 queue full,
5 timeout, 6 unknown job id.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Optional, Sequence

from producer_sdk._wire import DEFAULT_MAX_QUEUED_JOBS
from producer_sdk.cli_common import add_connection_flags
from producer_sdk.client import Client
from producer_sdk.config import default_redis_url
from producer_sdk.errors import InvalidRequest, JobFailed, JobNotFound, QueueFull, RedisUnavailable
from producer_sdk.protocol import GROUP, Keys

EXIT_FAILED, EXIT_INVALID, EXIT_UNAVAILABLE, EXIT_FULL, EXIT_TIMEOUT = 1, 2, 3, 4, 5
EXIT_UNKNOWN = 6                # status/result of a job id Redis does not know


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m producer_sdk",
                                     description="tokenrelay producer: submit jobs, run OpenAI-"
                                                 "format batch files, inspect queues.")
    sub = parser.add_subparsers(dest="command", required=True)
    _submit_parser(sub.add_parser("submit", help="submit one prompt and print its output"))
    _batch_parser(sub.add_parser("batch", help="run an OpenAI Batch JSONL file (resumable)"))
    stats = sub.add_parser("stats", help="queue depth, lag, pending, workers, dead letters")
    stats.add_argument("--json", action="store_true", help="print JSON instead of a table")
    stats.add_argument("--live-s", type=float, default=10.0,
                       help="a worker is live if it beat within this many seconds")
    cancel = sub.add_parser("cancel", help="cancel a job by id")
    cancel.add_argument("job_id")
    status = sub.add_parser("status", help="where a job stands (queued, running, done, ...), "
                                           "or every job of a batch (--batch INPUT)")
    status.add_argument("job_id", nargs="?")
    status.add_argument("--batch", default=None, metavar="INPUT",
                        help="the batch input JSONL: one line per job, then the counts by state")
    status.add_argument("--batch-id", default=None,
                        help="the batch's id, when it was given to 'batch' [hash of INPUT]")
    status.add_argument("--json", action="store_true", help="print JSON instead of a line")
    result = sub.add_parser("result", help="wait for a job and print its output")
    result.add_argument("job_id")
    result.add_argument("--timeout", type=float, default=None, help="seconds to wait")
    result.add_argument("--json", action="store_true", help="print the Result as JSON")
    add_connection_flags(parser, top=True, queue_help="; stats: all queues")
    for p in sub.choices.values():
        add_connection_flags(p, top=False, queue_help="; stats: all queues")
    return parser


def _submit_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="send as one user chat message")
    p.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--n", type=int, help="sampled choices; with more than one, each output "
                   "line starts with [choice]")
    p.add_argument("--beam-width", type=int, help="beam search with this many beams (each "
                   "printed, best first, as [rank] lines)")
    p.add_argument("--length-penalty", type=float, help="beam search length penalty")
    p.add_argument("--priority", type=int, default=0, help="<0 urgent lane, >0 bulk lane")
    p.add_argument("--job-id", default=None)
    p.add_argument("--timeout", type=float, default=None, help="seconds to wait for the result")
    p.add_argument("--block", action="store_true", help="wait for room when the queue is full")
    p.add_argument("--json", action="store_true", help="print the final Result as JSON")


def _batch_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="OpenAI Batch input JSONL")
    p.add_argument("output", help="results JSONL (appended to; rerun to resume)")
    p.add_argument("--errors", default=None, help="errors JSONL [OUTPUT with .errors.jsonl]")
    p.add_argument("--concurrency", type=int, default=256, help="max jobs in flight [256]")
    p.add_argument("--batch-id", default=None,
                   help="names the jobs; reruns with the same id resume [hash of the input]")
    p.add_argument("--priority", type=int, default=1, help="job priority [1: bulk lane]")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    url = args.redis_url or default_redis_url()
    queue = args.queue or "default"
    try:
        if args.command == "stats":
            return cmd_stats(url, args)
        with Client(url, queue=queue, namespace=args.namespace) as client:
            if args.command == "submit":
                return cmd_submit(client, args)
            if args.command == "batch":
                return cmd_batch(client, args)
            if args.command == "status":
                return cmd_status(client, args)
            if args.command == "result":
                return cmd_result(client, args)
            client.cancel(args.job_id)
            print(f"cancel requested for {args.job_id}")
            return 0
    except RedisUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except InvalidRequest as exc:
        print(f"error: invalid request: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except QueueFull as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FULL
    except JobFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except TimeoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT
    except JobNotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_UNKNOWN
    except BrokenPipeError:         # the reader left: cli_common.run_cli ends quietly
        raise
    except OSError as exc:          # a missing batch input, output folder, ...
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except ValueError as exc:       # e.g. a job id with spaces or braces
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_INVALID


def cmd_submit(client: Client, args: argparse.Namespace) -> int:
    sampling = {k: v for k, v in (("max_tokens", args.max_tokens),
                                  ("temperature", args.temperature), ("top_p", args.top_p),
                                  ("top_k", args.top_k), ("seed", args.seed),
                                  ("stop", args.stop), ("n", args.n),
                                  ("beam_width", args.beam_width),
                                  ("length_penalty", args.length_penalty)) if v is not None}
    source = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {
        "prompt": args.prompt}
    job = client.submit(**source, job_id=args.job_id, priority=args.priority,
                        stream=args.stream, block=args.block, **sampling)
    print(f"job {job.id}", file=sys.stderr)
    several = (args.n or 1) > 1 or args.beam_width is not None
    try:
        if args.stream:
            lines = ChoiceLines(sys.stdout) if several else None
            for delta in job.stream(timeout=args.timeout):
                if lines is not None:
                    lines.feed(delta)
                else:
                    sys.stdout.write(delta.text)
                sys.stdout.flush()
            result = job.result(timeout=args.timeout)
            if lines is not None:
                lines.close()
            else:
                sys.stdout.write("\n")
        else:
            result = job.result(timeout=args.timeout)
            if args.json:
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


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    """Exit 0 for a known job, 6 for an unknown id."""
    if args.batch is not None:
        return cmd_batch_status(client, args)
    if args.job_id is None:
        raise InvalidRequest("status needs a JOB_ID or --batch INPUT")
    st = client.status(args.job_id)
    print(st.model_dump_json() if args.json else _status_line(st.job_id, st))
    return EXIT_UNKNOWN if st.state == "unknown" else 0


def _status_line(name: str, st: Any) -> str:
    shown = {k: v for k, v in st.model_dump(exclude={"job_id", "state"}).items()
             if v not in (None, False, 0) or (k == "position" and v == 0)}
    return " ".join([name, st.state, *(f"{k}={v}" for k, v in shown.items())])


def cmd_batch_status(client: Client, args: argparse.Namespace) -> int:
    """Every job of a batch, found from its input file (job ids are derived from the batch id
    and each line's custom_id, as the batch runner names them); then the counts by state."""
    from pathlib import Path

    from producer_sdk.batch import scan_input
    from producer_sdk.openai_format import job_id_for
    path = Path(args.batch)
    batch_id = args.batch_id or f"batch_{scan_input(path)[1][:24]}"
    custom_ids = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                cid = json.loads(line).get("custom_id")
            except (ValueError, AttributeError):
                continue
            if isinstance(cid, str) and cid:
                custom_ids.append(cid)
    statuses = client.statuses([job_id_for(batch_id, c) for c in custom_ids])
    counts: dict[str, int] = {}
    for cid, st in zip(custom_ids, statuses):
        counts[st.state] = counts.get(st.state, 0) + 1
        print(json.dumps({"custom_id": cid, **st.model_dump()}) if args.json
              else _status_line(cid, st))
    print(json.dumps({"batch_id": batch_id, "jobs": len(statuses), **counts}), file=sys.stderr)
    return 0


def cmd_result(client: Client, args: argparse.Namespace) -> int:
    result = client.get(args.job_id).result(timeout=args.timeout)
    print(result.model_dump_json() if args.json else result.text)
    return 0


def cmd_batch(client: Client, args: argparse.Namespace) -> int:
    from producer_sdk.batch import BatchRunner
    runner = BatchRunner(client, args.input, args.output, args.errors, batch_id=args.batch_id,
                         concurrency=args.concurrency, priority=args.priority,
                         progress=not args.no_progress)
    try:
        summary = runner.run()
    except KeyboardInterrupt:
        print("\ninterrupted: jobs in flight keep running; rerun the same command to resume",
              file=sys.stderr)
        return 130
    print(json.dumps(summary.as_dict()), file=sys.stderr)
    if summary.total_lines and not (summary.succeeded + summary.failed + summary.skipped):
        print(f"error: no line of {args.input} is a valid request (see {runner.errors})",
              file=sys.stderr)
        return EXIT_INVALID
    return 0


# --------------------------------------------------------------------------------------------
# stats
# --------------------------------------------------------------------------------------------

def discover_queues(r: Any, namespace: str) -> list[str]:
    """Queue names with any key in this namespace (jobs lanes, workers, config, dead letters)."""
    names = set()
    for kind in ("jobs", "workers", "config", "dead"):
        for key in r.scan_iter(match=f"{namespace}:{kind}:*", count=1000):
            parts = key.decode().split(":")
            if len(parts) >= 3:
                names.add(parts[2])
    return sorted(names)


def queue_stats(r: Any, keys: Keys, live_s: float) -> dict[str, Any]:
    lanes = {}
    for name in keys.LANES:
        lane = keys.lane(name)
        info = {"length": r.xlen(lane), "lag": None, "pending": 0, "consumers": 0}
        try:
            groups = r.xinfo_groups(lane)
        except Exception:  # no such stream yet
            groups = []
        for g in groups:
            if _s(g.get("name")) == GROUP:
                info.update(lag=g.get("lag"), pending=g.get("pending", 0),
                            consumers=g.get("consumers", 0))
        if info["lag"] is None:
            # Redis reports no lag after some deletions; acknowledged entries are deleted, so
            # what is in the stream and not pending has not been delivered yet.
            info["lag"] = max(0, info["length"] - info["pending"])
        lanes[name] = info
    now_ms = int(time.time() * 1000)
    limit = r.hget(keys.config, "max_queued_jobs")
    return {
        "queue": keys.queue,
        "depth": sum(li["length"] for li in lanes.values()),
        "lag": sum(li["lag"] for li in lanes.values()),
        "pending": sum(li["pending"] for li in lanes.values()),
        "lanes": lanes,
        "workers_live": r.zcount(keys.workers, now_ms - int(live_s * 1000), "+inf"),
        "workers_known": r.zcard(keys.workers),
        "dead_letters": r.xlen(keys.dead),
        "max_queued_jobs": int(limit) if limit is not None else None,
    }


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def cmd_stats(url: str, args: argparse.Namespace) -> int:
    import redis
    from producer_sdk.client_core import NET_ERRORS, make_redis
    from producer_sdk.config import ClientConfig
    from producer_sdk._wire import redact_url
    r = make_redis(ClientConfig(redis_url=url))
    try:
        queues = [args.queue] if args.queue else discover_queues(r, args.namespace)
        stats = [queue_stats(r, Keys(args.namespace, q), args.live_s) for q in queues]
    except NET_ERRORS as exc:
        raise RedisUnavailable(redact_url(url), exc) from exc
    except redis.ResponseError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        r.close()
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        print(_table(stats, args.namespace))
    return 0


def _table(stats: list[dict[str, Any]], namespace: str) -> str:
    if not stats:
        return f"no queues in namespace {namespace!r}"
    head = ("queue", "depth", "lag", "pending", "urgent/default/bulk", "workers live/known",
            "dead", "max_queued")
    rows = [head]
    for s in stats:
        ln = s["lanes"]
        limit = s["max_queued_jobs"]
        rows.append((s["queue"], str(s["depth"]), str(s["lag"]), str(s["pending"]),
                     f"{ln['urgent']['length']}/{ln['default']['length']}/{ln['bulk']['length']}",
                     f"{s['workers_live']}/{s['workers_known']}", str(s["dead_letters"]),
                     str(limit) if limit is not None else f"{DEFAULT_MAX_QUEUED_JOBS} (default)"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
