"""``python -m worker admin``: look into the queue and repair it by hand.

Operators need four things when something goes wrong: which jobs are held by whom and for how
long (a stuck or crash-looping worker shows as growing idle times and delivery counts), which jobs
were given up on (dead letters) and the means to replay or purge them, and a way to take one worker
out of service gracefully (drain) without shell access to its host.

Nothing here bypasses the workers' invariants: replay re-enqueues through the same lane and
dedupe record a producer would use, and draining only sets a flag the worker itself polls.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Iterator, Optional, Sequence

import redis as redis_lib
from pydantic import Field

from producer_sdk._wire import redact_url
from producer_sdk.cli_common import (
    ConnectionSettings, JsonOutput, add_settings_flags, parse_settings, unset,
)
from producer_sdk.protocol import (
    GROUP, PAYLOAD_FIELD, DeadLetter, ErrorCode, Keys, decode_job,
)
from worker.deadletters import payload_job_id
from worker.scripts import REPLAY, run_script

# A drain flag (Keys.drain) expires, so a flag for a worker that never came back cannot drain
# the next process started under that id an hour later.
DRAIN_TTL_S = 3600
DEDUPE_TTL_S = 86_400
_PAGE = 500


def _s(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


# --------------------------------------------------------------------------------------------
# pending jobs
# --------------------------------------------------------------------------------------------

@dataclass
class PendingJob:
    """One job stream entry read by a worker and not yet acknowledged."""

    lane: str
    entry_id: str
    consumer: str
    idle_ms: int
    deliveries: int
    job_id: str
    owner: str           # fencing record <worker_id>:<token>, "" when none
    consumer_alive: bool  # the consumer's heartbeat key exists


def _pending_rows(r: Any, lane: str) -> Iterator[dict]:
    """XPENDING's extended form, page by page (exclusive ranges need Redis 6.2+)."""
    start = "-"
    while True:
        rows = r.xpending_range(lane, GROUP, min=start, max="+", count=_PAGE)
        yield from rows
        if len(rows) < _PAGE:
            return
        start = "(" + _s(rows[-1]["message_id"])


def _job_id_of(r: Any, lane: str, entry_id: str) -> str:
    entries = r.xrange(lane, entry_id, entry_id)
    if not entries:
        return ""  # payload deleted; the next reclaim drops it
    return payload_job_id(entries[0][1].get(PAYLOAD_FIELD)) or ""


def list_pending(r: Any, keys: Keys) -> list[PendingJob]:
    """Every pending entry of every lane, most urgent lane first, oldest entry first."""
    out = []
    alive: dict[str, bool] = {}
    for lane in keys.lanes():
        if not r.exists(lane):
            continue
        try:
            rows = list(_pending_rows(r, lane))
        except redis_lib.ResponseError:  # NOGROUP: no worker ever started on this lane
            continue
        for row in rows:
            consumer, entry_id = _s(row["consumer"]), _s(row["message_id"])
            if consumer not in alive:
                alive[consumer] = bool(r.exists(keys.heartbeat(consumer)))
            job_id = _job_id_of(r, lane, entry_id)
            owner = _s(r.get(keys.owner(job_id)) or b"") if job_id else ""
            out.append(PendingJob(lane, entry_id, consumer, int(row["time_since_delivered"]),
                                  int(row["times_delivered"]), job_id, owner, alive[consumer]))
    return out


def list_workers(r: Any, keys: Keys) -> list[dict]:
    """Workers from the heartbeat sorted set, with the age of their last beat."""
    now = time.time() * 1000
    out = []
    for member, score in r.zrange(keys.workers, 0, -1, withscores=True):
        wid = _s(member)
        out.append({"worker_id": wid, "last_beat_ms_ago": int(now - score),
                    "heartbeat_key": bool(r.exists(keys.heartbeat(wid))),
                    "draining": bool(r.exists(keys.drain(wid)))})
    return out


# --------------------------------------------------------------------------------------------
# dead letters
# --------------------------------------------------------------------------------------------

def list_dead(r: Any, keys: Keys, count: Optional[int] = None) -> list[tuple[str, DeadLetter]]:
    """Dead letters, oldest first."""
    return [(_s(eid), DeadLetter.from_fields(fields))
            for eid, fields in r.xrange(keys.dead(), count=count)]


def _select_dead(r: Any, keys: Keys, ids: Sequence[str]) -> list[tuple[str, DeadLetter]]:
    if not ids:
        return list_dead(r, keys)
    out = []
    for eid in ids:
        found = r.xrange(keys.dead(), eid, eid)
        if not found:
            raise KeyError(f"no dead letter {eid} in {keys.dead()}")
        out.append((eid, DeadLetter.from_fields(found[0][1])))
    return out


def replay_dead(r: Any, keys: Keys, ids: Sequence[str] = ()) -> list[tuple[str, str]]:
    """Re-enqueue dead letters (all when ``ids`` is empty); returns ``(job_id, new entry id)``.

    The job keeps its id, so its result stream is deleted first: it ends with the poison error,
    and a worker that finds a terminal event there would treat the job as already finished. The
    job id's dedupe record is pointed at the new entry (identity binding: workers run only the
    entry it names). Clients waiting on the job must subscribe again. Skipped, and left in the
    dead-letter stream: letters without a payload or with a truncated one, and duplicate_job_id
    letters (replaying one would take the job id over from the job it belongs to).
    """
    done = []
    for dead_id, letter in _select_dead(r, keys, ids):
        if not letter.data or letter.truncated or letter.code == ErrorCode.DUPLICATE_JOB_ID.value:
            continue
        job = decode_job(letter.data)
        lane = letter.lane if letter.lane in keys.lanes() else keys.jobs_stream(job.priority)
        new_id = _s(run_script(r, REPLAY, [lane, keys.dedupe(job.job_id),
                                           keys.results(job.job_id), keys.owner(job.job_id),
                                           keys.cancel(job.job_id)],
                               [letter.data, DEDUPE_TTL_S]))
        r.xdel(keys.dead(), dead_id)
        done.append((job.job_id, new_id))
    return done


def purge_dead(r: Any, keys: Keys, ids: Sequence[str] = ()) -> int:
    """Delete dead letters (all when ``ids`` is empty); returns how many."""
    if not ids:
        n = int(r.xlen(keys.dead()))
        r.delete(keys.dead())
        return n
    return int(r.xdel(keys.dead(), *ids))


# --------------------------------------------------------------------------------------------
# draining
# --------------------------------------------------------------------------------------------

def request_drain(r: Any, keys: Keys, worker_id: str, ttl_s: int = DRAIN_TTL_S) -> bool:
    """Ask a worker to drain and exit; returns whether it currently has a heartbeat."""
    r.set(keys.drain(worker_id), str(int(time.time())), ex=ttl_s)
    return bool(r.exists(keys.heartbeat(worker_id)))


def drain_requested(r: Any, keys: Keys, worker_id: str) -> bool:
    """What the worker polls (with its heartbeat)."""
    return bool(r.exists(keys.drain(worker_id)))


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

class AdminSettings(ConnectionSettings, JsonOutput):
    """What every admin subcommand takes: the connection and --json."""


class DeadListSettings(AdminSettings):
    count: Optional[int] = Field(None, ge=1, description="List at most this many, oldest first.",
                                 json_schema_extra=unset("all"))


def configure_parser(p: argparse.ArgumentParser) -> None:
    """The admin subcommands under ``p``; each level takes the admin settings, so they may come
    before or after a subcommand. ``--all`` of replay/purge says which letters, like the ids, so
    it is an argument and not a setting: an environment variable must never purge everything."""
    add_settings_flags(p, AdminSettings)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, what in (("pending", "pending jobs: owner, idle time, delivery count"),
                       ("workers", "workers and their last heartbeat")):
        add_settings_flags(sub.add_parser(name, help=what), AdminSettings)
    dead_parser = sub.add_parser("dead", help="dead letters")
    add_settings_flags(dead_parser, AdminSettings)
    dead = dead_parser.add_subparsers(dest="action", required=True)
    add_settings_flags(dead.add_parser("list", help="list dead letters"), DeadListSettings)
    for name, what in (("replay", "re-enqueue"), ("purge", "delete")):
        a = dead.add_parser(name, help=f"{what} dead letters")
        a.add_argument("ids", nargs="*", help="dead-letter entry ids")
        a.add_argument("--all", action="store_true", help=f"{what} every dead letter")
        add_settings_flags(a, AdminSettings)
    d = sub.add_parser("drain", help="ask a worker to finish or hand back its jobs and exit")
    d.add_argument("worker_id")
    add_settings_flags(d, AdminSettings)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m worker admin",
                                description="Inspect pending jobs and workers, manage dead "
                                            "letters, drain a worker.")
    configure_parser(p)
    return p


def _connect(settings: AdminSettings) -> tuple[Any, Keys]:
    keys = Keys(settings.namespace, settings.queue)
    return redis_lib.Redis.from_url(settings.redis_url, socket_timeout=10), keys


def _emit(settings: AdminSettings, rows: Iterable[dict], columns: Sequence[str]) -> None:
    rows = list(rows)
    if settings.json:
        print(json.dumps(rows, default=str))
        return
    print("  ".join(columns))
    for row in rows:
        print("  ".join(str(row.get(c, "")) for c in columns))


def _dead_row(eid: str, letter: DeadLetter) -> dict:
    return {"dead_id": eid, "job_id": letter.job_id, "code": letter.code, "lane": letter.lane,
            "entry_id": letter.entry_id, "deliveries": letter.deliveries,
            "worker_id": letter.worker_id, "reason": letter.reason,
            "payload_bytes": len(letter.data)}


EXIT_UNREACHABLE = 3     # as python -m producer_sdk


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m worker admin`` on its own (``python -m worker`` parses the same tree)."""
    args, settings = parse_settings(build_parser(), argv)
    return run(args, settings)


def run(args: argparse.Namespace, settings: AdminSettings) -> int:
    """Redis errors end the command with one line: 3 when Redis cannot be reached, 78 for a
    configuration error (password, ACL, TLS), 1 for anything else Redis refused."""
    try:
        return _run(args, settings)
    except redis_lib.RedisError as exc:
        from worker.connection import EXIT_CONFIG, ErrorKind, classify, describe_permanent
        url = settings.redis_url
        if classify(exc) is ErrorKind.PERMANENT:
            print(f"error: {describe_permanent(exc, url)}", file=sys.stderr)
            return EXIT_CONFIG
        unreachable = isinstance(exc, (redis_lib.ConnectionError, redis_lib.TimeoutError))
        what = "cannot reach Redis" if unreachable else "Redis refused the command"
        print(f"error: {what} at {redact_url(url)}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE if unreachable else 1


def _run(args: argparse.Namespace, settings: AdminSettings) -> int:
    r, keys = _connect(settings)
    if args.cmd == "pending":
        _emit(settings, (asdict(p) for p in list_pending(r, keys)),
              ("lane", "entry_id", "job_id", "consumer", "consumer_alive", "idle_ms",
               "deliveries", "owner"))
    elif args.cmd == "workers":
        _emit(settings, list_workers(r, keys),
              ("worker_id", "last_beat_ms_ago", "heartbeat_key", "draining"))
    elif args.cmd == "drain":
        alive = request_drain(r, keys, args.worker_id)
        print(f"drain requested for {args.worker_id}"
              + ("" if alive else " (warning: no live heartbeat under that id)"))
    elif args.action == "list":
        assert isinstance(settings, DeadListSettings)
        _emit(settings, (_dead_row(e, d) for e, d in list_dead(r, keys, settings.count)),
              ("dead_id", "job_id", "code", "deliveries", "lane", "entry_id", "worker_id",
               "reason"))
    else:
        if not args.ids and not args.all:
            print("give dead-letter ids or --all", file=sys.stderr)
            return 2
        if args.action == "replay":
            for job_id, new_id in replay_dead(r, keys, args.ids):
                print(f"replayed {job_id} as {new_id}")
        else:
            print(f"purged {purge_dead(r, keys, args.ids)} dead letter(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
