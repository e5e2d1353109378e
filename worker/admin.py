"""``tokenrelay admin``: look into the queue and repair it by hand.

Operators need four things when something goes wrong: which jobs are held by whom and for how
long (a stuck or crash-looping worker shows as growing idle times and delivery counts), which jobs
were given up on (dead letters) and the means to replay or purge them, and a way to take one worker
out of service gracefully (drain) without shell access to its host. ``unread`` lists the job
streams of the queue no worker reads (``protocol.lanes``), with their depth, and
``recount-budget`` repairs the token budget's counters after Redis lost writes.

Every command works on a queue of any shard count (the count the queue's workers registered;
--shards must agree) and against a Redis Cluster (pending entries and dead letters are read
from every shard's streams, each on the node serving it).

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

from tokenrelay.protocol.topology import ClusterModeError, redact_url
from tokenrelay.protocol.settings import (ConnectionSettings, JsonOutput, add_settings_flags, parse_settings,
                               unset)
from tokenrelay.protocol.errors import ErrorCode, ProtocolError
from tokenrelay.protocol.events import is_terminal
from tokenrelay.protocol.keys import EVENT_FIELD, GROUP, Keys, PAYLOAD_FIELD
from tokenrelay.protocol.lanes import unread_lanes
from tokenrelay.protocol.scripts import RECOUNT_BUDGET, REPLAY, run_script
from tokenrelay.protocol.wire import DeadLetter, decode_event, decode_job
from tokenrelay.protocol.shards import ShardCountMismatch, registered_shards, resolve_shards
from tokenrelay.worker.connection import (EXIT_CONFIG, REDIS_ERRORS, ErrorKind, classify, client_for,
                               describe_permanent)
from tokenrelay.worker.deadletters import payload_job_id

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
    """Every pending entry of every lane of every shard, shard by shard, most urgent lane
    first, oldest entry first."""
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
            owner = (_s(r.get(keys.owner(job_id, keys.shard_of_stream(lane))) or b"")
                     if job_id else "")
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

def _id_order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _dead_entries(r: Any, keys: Keys, count: Optional[int] = None
                  ) -> list[tuple[int, str, DeadLetter]]:
    """(shard, entry id, letter) from every shard's dead-letter stream, oldest first."""
    rows = [(shard, _s(eid), DeadLetter.from_fields(fields))
            for shard, stream in enumerate(keys.dead_streams())
            for eid, fields in r.xrange(stream, count=count)]
    rows.sort(key=lambda row: _id_order(row[1]))
    return rows[:count] if count else rows


def dead_id(keys: Keys, shard: int, entry_id: str) -> str:
    """How a dead letter is named: its entry id, prefixed ``<shard>/`` on a queue of several
    shards (each shard's dead-letter stream makes its own ids: they collide across shards)."""
    return entry_id if keys.shards == 1 else f"{shard}/{entry_id}"


def list_dead(r: Any, keys: Keys, count: Optional[int] = None) -> list[tuple[str, DeadLetter]]:
    """Dead letters of every shard, oldest first, by ``dead_id``."""
    return [(dead_id(keys, shard, eid), letter)
            for shard, eid, letter in _dead_entries(r, keys, count)]


def _find_dead(r: Any, keys: Keys, name: str) -> list[tuple[int, str, DeadLetter]]:
    """The letters ``name`` may mean: ``<shard>/<entry id>``, or an entry id in any shard."""
    where, _, eid = name.rpartition("/")
    if where:
        shards: Sequence[int] = ([int(where)] if where.isdigit() and int(where) < keys.shards
                                 else [])
    else:
        shards = range(keys.shards)
    return [(s, eid, DeadLetter.from_fields(hit[0][1])) for s in shards
            for hit in [r.xrange(keys.dead(s), eid, eid)] if hit]


def _select_dead(r: Any, keys: Keys, ids: Sequence[str]) -> list[tuple[int, str, DeadLetter]]:
    """The letters ``ids`` (``dead_id`` names) name, all when empty; KeyError for a name that
    names none, or several (the same entry id in several shards' streams)."""
    if not ids:
        return _dead_entries(r, keys)
    out = []
    for name in ids:
        found = _find_dead(r, keys, name)
        if not found:
            raise KeyError(f"no dead letter {name} in {', '.join(keys.dead_streams())}")
        if len(found) > 1:
            raise KeyError(f"{name} names a dead letter in several shards; give "
                           f"<shard>/{name} as 'dead list' shows it")
        out += found
    return out


def _replay_lane(keys: Keys, letter: DeadLetter, priority: int, job_id: str) -> str:
    """Where a replayed letter goes: the lane it was read from, when that is a lane of this
    queue (its shard), else the job's priority lane on the shard its id maps to."""
    if letter.lane in keys.lanes():
        return letter.lane
    return keys.jobs_stream(priority, keys.shard_of(job_id))


def replay_dead(r: Any, keys: Keys, ids: Sequence[str] = ()) -> list[tuple[str, str]]:
    """Re-enqueue dead letters (all when ``ids`` is empty); returns ``(job_id, new entry id)``.

    The job keeps its id, so its result stream is deleted first: it ends with the poison error,
    and a worker that finds a terminal event there would treat the job as already finished. The
    job id's dedupe record is pointed at the new entry (identity binding: workers run only the
    entry it names); the job's keys are those of the lane's shard, as a worker reading the new
    entry derives them. Clients waiting on the job must subscribe again. Skipped, and left in the
    dead-letter stream: letters without a payload or with a truncated one, and duplicate_job_id
    letters (replaying one would take the job id over from the job it belongs to).
    """
    done = []
    for shard, dead_id, letter in _select_dead(r, keys, ids):
        if not letter.data or letter.truncated or letter.code == ErrorCode.DUPLICATE_JOB_ID.value:
            continue
        job = decode_job(letter.data)
        lane = _replay_lane(keys, letter, job.priority, job.job_id)
        at = keys.shard_of_stream(lane)
        new_id = _s(run_script(r, REPLAY, [lane, keys.dedupe(job.job_id, at),
                                           keys.results(job.job_id, at),
                                           keys.owner(job.job_id, at),
                                           keys.cancel(job.job_id, at)],
                               [letter.data, DEDUPE_TTL_S]))
        r.xdel(keys.dead(shard), dead_id)
        done.append((job.job_id, new_id))
    return done


def purge_dead(r: Any, keys: Keys, ids: Sequence[str] = ()) -> int:
    """Delete dead letters of every shard (all when ``ids``, ``dead_id`` names, is empty);
    returns how many."""
    if not ids:
        n = sum(int(r.xlen(stream)) for stream in keys.dead_streams())
        for stream in keys.dead_streams():
            r.delete(stream)
        return n
    return sum(int(r.xdel(keys.dead(shard), eid)) for name in ids
               for shard, eid, _ in _find_dead(r, keys, name))


# --------------------------------------------------------------------------------------------
# token budget
# --------------------------------------------------------------------------------------------

def _ended(r: Any, results_key: str) -> bool:
    """Whether a job's result stream ends with its terminal event (its cost was released)."""
    last = r.xrevrange(results_key, count=1)
    if not last:
        return False
    try:
        return is_terminal(decode_event(last[0][1].get(EVENT_FIELD)))
    except (ProtocolError, ValueError):   # unreadable: not this job's terminal write
        return False


def _released(r: Any, keys: Keys, shard: int, streams: Sequence[str]) -> list[str]:
    """``'<KEYS index>/<entry id>'`` (RECOUNT_BUDGET's ARGV) of the shard's pending entries
    whose job already has its terminal event: released, waiting for their ack."""
    out = []
    for k, stream in enumerate(streams, start=2):
        try:
            rows = list(_pending_rows(r, stream))
        except redis_lib.ResponseError:     # NOGROUP: nobody read this stream yet
            continue
        for row in rows:
            entry_id = _s(row["message_id"])
            job_id = _job_id_of(r, stream, entry_id)
            if job_id and _ended(r, keys.results(job_id, shard)):
                out.append(f"{k}/{entry_id}")
    return out


def recount_budget(r: Any, keys: Keys) -> list[dict]:
    """Set every shard's token budget counter to the costs of its jobs still queued or running:
    entries in its lanes and in the affinity streams of the queue's registered workers, less
    those whose terminal event is written. A job that ends between the scan of pending entries
    and the script is counted once too many until the next recount (one round trip's window)."""
    workers = [_s(w) for w in r.zrange(keys.workers, 0, -1)]
    rows = []
    for shard in range(keys.shards):
        streams = keys.lanes(shard) + [keys.affinity(w, shard) for w in workers]
        before, now = run_script(r, RECOUNT_BUDGET, [keys.budget(shard), *streams],
                                 _released(r, keys, shard, streams))
        rows.append({"shard": shard, "key": keys.budget(shard),
                     "before": int(before) if before else 0, "now": int(now)})
    return rows


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
                       ("workers", "workers and their last heartbeat"),
                       ("unread", "job streams of the queue no worker reads, with their depth "
                                  "(outside the registered shard layout, or no consumer group "
                                  "yet)"),
                       ("recount-budget", "set each shard's token budget counter to the costs "
                                          "of its jobs still queued or running")):
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
    p = argparse.ArgumentParser(prog="tokenrelay admin",
                                description="Inspect pending jobs and workers, manage dead "
                                            "letters, drain a worker, recount token budgets.")
    configure_parser(p)
    return p


def _connect(settings: AdminSettings) -> tuple[Any, Keys]:
    """A client (a cluster client when the server is a cluster node, or --cluster on) and the
    queue's keys with its registered shard count (--shards must match it when given)."""
    r = client_for(settings.redis_url, settings.cluster, socket_timeout=10)
    base = Keys(settings.namespace, settings.queue)
    shards = resolve_shards(settings.shards, registered_shards(r, base), base)
    return r, Keys(settings.namespace, settings.queue, shards)


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


EXIT_UNREACHABLE = 3     # as tokenrelay


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``tokenrelay admin`` on its own (``tokenrelay worker`` parses the same tree)."""
    args, settings = parse_settings(build_parser(), argv)
    return run(args, settings)


def run(args: argparse.Namespace, settings: AdminSettings) -> int:
    """Redis errors end the command with one line: 3 when Redis cannot be reached, 78 for a
    configuration error (password, ACL, TLS, --cluster on against a plain server, a --shards
    the queue was not registered with), 1 for anything else Redis refused."""
    try:
        return _run(args, settings)
    except ShardCountMismatch as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyError as exc:   # a dead-letter id that names no letter, or several
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 1
    except (*REDIS_ERRORS, ClusterModeError) as exc:
        url = settings.redis_url
        if classify(exc) is ErrorKind.PERMANENT:
            print(f"error: {describe_permanent(exc, url)}", file=sys.stderr)
            return EXIT_CONFIG
        unreachable = isinstance(exc, (redis_lib.ConnectionError, redis_lib.TimeoutError,
                                       redis_lib.exceptions.RedisClusterException))
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
    elif args.cmd == "unread":
        _emit(settings, (asdict(u) for u in unread_lanes(r, keys)),
              ("key", "depth", "reason", "detail"))
    elif args.cmd == "recount-budget":
        _emit(settings, recount_budget(r, keys), ("shard", "key", "before", "now"))
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
