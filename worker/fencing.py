"""Fencing a job's result stream: every write checks, atomically inside Redis, that this worker
still owns the job.

Why: XADD takes no owner, so a worker that was paused after its job was reclaimed would otherwise
write into the new owner's result stream. ``Keys.owner(job_id)`` holds ``<worker_id>:<token>``; a
worker sets it (fresh token) when it starts a job, after binding the job id to the entry it runs
(``Keys.dedupe``: identity, see docs/contracts.md). The result stream shares the owner record's
hash slot (every per-job key carries the hash tag of the queue shard whose stream held the entry),
so one script checks the owner and appends, and one script call writes every job of a step that
came from the same shard (protocol/scripts/results.py). Acks are fenced by the pending list instead
(worker/pending.py).
"""

from __future__ import annotations

import secrets
from enum import Enum
from typing import Any, Optional, Sequence

import msgpack

from tokenrelay.protocol.keys import Keys, dedupe_record
from tokenrelay.protocol.scripts import BIND_AND_OWN, RELEASE_OWNER, WRITE_STEP, ScriptPipeline, text


class WriteStatus(str, Enum):
    OK = "ok"
    DUP = "dup"
    REFUSED = "refused"
    MISSING = "missing"
    GONE = "gone"
    BEHIND = "behind"    # the stream lost events this writer saw land (failover, restart): resume
    SKIP = "skip"
    ERROR = "error"

    @property
    def written(self) -> bool:
        return self in (WriteStatus.OK, WriteStatus.DUP)


_STEP_CODES = {"o": WriteStatus.OK, "d": WriteStatus.DUP, "r": WriteStatus.REFUSED,
               "m": WriteStatus.MISSING, "g": WriteStatus.GONE, "b": WriteStatus.BEHIND, "s": WriteStatus.SKIP,
               "e": WriteStatus.ERROR}


STEP_KEYS_MEMO = 65_536   # jobs whose step keys a Fence remembers (far above max_num_seqs)


def new_owner_value(worker_id: str) -> str:
    """A fresh ``<worker_id>:<token>``: the token tells apart two lives of the same worker id."""
    return f"{worker_id}:{secrets.token_hex(8)}"


class Fence:
    """Builds one worker's fenced result-stream commands into a ScriptPipeline."""

    def __init__(self, keys: Keys, dedupe_ttl_s: int = 86_400) -> None:
        self.keys = keys
        self.dedupe_ttl_s = int(dedupe_ttl_s)
        self._step_keys: dict[tuple[str, int], tuple[bytes, bytes, bytes]] = {}

    def step_keys(self, job_id: str, shard: int) -> tuple[bytes, bytes, bytes]:
        """A job's owner, results and cancel keys, built and UTF-8 encoded once per job rather
        than per step (three key builds and encodes per running job per step were a measurable
        share of the worker's CPU, issue #29). Bounded: the memo starts over past
        ``STEP_KEYS_MEMO`` jobs."""
        found = self._step_keys.get((job_id, shard))
        if found is None:
            if len(self._step_keys) >= STEP_KEYS_MEMO:
                self._step_keys.clear()
            k = self.keys
            found = self._step_keys[(job_id, shard)] = (
                k.owner(job_id, shard).encode(), k.results(job_id, shard).encode(),
                k.cancel(job_id, shard).encode())
        return found

    def bind_and_own(self, pipe: ScriptPipeline, job_id: str, shard: int, lane_key: str,
                     entry_id: str, owner: str, ttl_ms: int) -> int:
        """Bind the job id to this entry (or find it bound to another) and, when it is ours,
        make ``owner`` the job's owner: from then on every write of a previous owner is
        refused. Call only for an entry this consumer holds; ``shard`` is that of the stream
        the entry was read from (never the job id's hash: see ``Keys``); see ``bound`` and
        ``entry_lost`` (the lane no longer holds the entry: nothing was touched)."""
        return pipe.script(BIND_AND_OWN, [self.keys.dedupe(job_id, shard),
                                          self.keys.owner(job_id, shard), lane_key],
                           [dedupe_record(lane_key, entry_id), owner, int(ttl_ms),
                            self.dedupe_ttl_s, entry_id])

    def write_step(self, pipe: ScriptPipeline, ttl_ms: int, shard: int,
                   jobs: Sequence[tuple[str, str, str, Sequence[bytes], bool, int, bool]],
                   releases: Optional[Sequence[int]] = None) -> int:
        """All jobs of a step that hold entries of one queue shard, in one script call (their keys
        share the shard's slot): ``(job_id, owner, batch_id, events, create, known, refresh)``
        each (``known``: how many entries the worker knows the job's stream holds; every write is
        checked against the stream's length, so a retried batch that landed is not written twice
        and events a failover or a restart lost make the status BEHIND, with or without an error
        the worker saw; see protocol/scripts/results.py; ``refresh``: reset the TTLs); also
        reads each job's cancel flag. ``releases``, per job: its admitted token cost when its
        batch ends with its terminal event, else 0 (None: all 0); the script returns it to the
        shard's budget with that event, exactly once. Parse the reply with
        ``parse_step_reply``."""
        keys: list[bytes] = []
        spec = []
        for k, (job_id, owner, batch_id, events, create, known, refresh) in enumerate(jobs):
            keys += self.step_keys(job_id, shard)
            spec.append([owner, int(create), batch_id, int(known), list(events), int(refresh),
                         int(releases[k]) if releases else 0])
        keys.append(self.keys.budget(shard).encode())   # always the last key (see WRITE_STEP)
        # Old-spec raw strings: Redis's cmsgpack does not read the bin types.
        return pipe.script(WRITE_STEP, keys, [int(ttl_ms), msgpack.packb(spec, use_bin_type=False)])

    def release(self, pipe: ScriptPipeline, job_id: str, shard: int, owner: str) -> int:
        """Delete the owner record only if it is still ``owner`` (a hand-back)."""
        return pipe.script(RELEASE_OWNER, [self.keys.owner(job_id, shard)], [owner])


def bound(reply: Any) -> bool:
    """A BIND_AND_OWN reply: True when the job id is bound to this entry (and now owned)."""
    return reply == 1


def entry_lost(reply: Any) -> bool:
    """A BIND_AND_OWN reply: True when the entry's lane no longer holds it (Redis lost it);
    the script then touched nothing, and the worker must not run the job."""
    return reply in (b"lost", "lost")


def parse_step_reply(reply: Any) -> list[tuple[WriteStatus, bool, str]]:
    """Per job of a write_step call: (status, cancel flag set, error text or status name)."""
    codes, cancels, errors = text(reply[0]), text(reply[1]), list(reply[2] or [])
    why = {int(errors[i]): text(errors[i + 1]) for i in range(0, len(errors), 2)}
    out = []
    for j, (c, x) in enumerate(zip(codes, cancels), start=1):
        status = _STEP_CODES[c]
        out.append((status, x == "1", why.get(j, status.value)))
    return out
