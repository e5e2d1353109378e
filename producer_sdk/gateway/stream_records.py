"""Who holds a resumable stream, in Redis: one record per streamed job
(``protocol.keys.stream_session_key``), changed only by the scripts of
``protocol/scripts/streams.py``, so a resume racing the grace's end, two clients resuming at
once, or a reconnect that lands on another replica before the first one noticed the
disconnect, each have one atomic outcome (``resume.py`` has the why of resumable streams).

A connection holds the stream it sends (its token in the record). When its client leaves,
the stream is parked for ``--resume-grace-s`` and listed in the namespace's parked set; every
gateway sweeps that set and cancels the jobs whose grace ran out, so a job parked by a gateway
that died is still cancelled on time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from redis.exceptions import NoScriptError, RedisError

from tokenrelay.producer_sdk.gateway.errors import APIError, api_error
from tokenrelay.producer_sdk.gateway.resume import STREAMS_URL, StreamSpec
from tokenrelay.protocol.keys import parked_streams_key, stream_session_key
from tokenrelay.protocol.scripts.lua import LuaScript
from tokenrelay.protocol.scripts.streams import (CLAIM_STREAM, END_STREAM, EXPIRE_PARKED,
                                                 PARK_STREAM)

log = logging.getLogger("tokenrelay.producer_sdk.gateway")

SWEEP_BATCH = 100
MAX_PAUSE_S = 5.0


def new_token() -> str:
    return secrets.token_hex(8)


@dataclass
class Held:
    """A connection's hold on one job's stream (its token in the resume record)."""

    job_id: str
    token: str
    spec: StreamSpec


@dataclass(eq=False)
class Local:
    """This gateway's connection holding a stream. A resume of the same job on this gateway
    must wait until it let go: the shared readers follow one reader state per result stream,
    so a second state of the job would never be fed while the first is watched."""

    token: str
    feed: Any                       # its JobFeed: notified to wake it when it must stop
    stop: bool = False
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    checked: float = field(default_factory=time.monotonic)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)


def claim_error(outcome: str, job_id: str, grace_s: float) -> APIError:
    """The answer to a resume the record refused."""
    if outcome == "missing":
        return APIError(404, f"no resumable stream for job {job_id}: it was not a streamed "
                        f"request of this gateway, or its resume record expired "
                        f"(--resume-ttl-s); send the request again without Last-Event-ID",
                        "invalid_request_error", None, "stream_not_found")
    if outcome == "forbidden":
        return APIError(403, f"job {job_id} was started with another API key; only its own "
                        f"key may resume its stream", "permission_error", None,
                        "stream_forbidden")
    if outcome == "mismatch":
        return APIError(400, f"the body differs from the request that started job {job_id}: "
                        f"resend that request unchanged with Last-Event-ID, or resume with "
                        f"GET {STREAMS_URL}/{job_id}", "invalid_request_error",
                        "Last-Event-ID", "stream_mismatch")
    return APIError(410, f"job {job_id} was cancelled: no client resumed its stream within "
                    f"{grace_s:g} s of the disconnect (--resume-grace-s); send the request "
                    f"again without Last-Event-ID", "invalid_request_error", None,
                    "stream_cancelled")


class Streams:
    """The resume records of one gateway's streams, and the work owed on them: parking a
    stream whose client left, marking one that ended, and the sweep that cancels parked jobs
    whose grace ran out (of every gateway: one that died cannot cancel its own). Owed work is
    queued and sent by one task, retried while Redis is down, as ``Cancels`` does: a request
    being torn down cannot wait for Redis."""

    def __init__(self, redis: Any, namespace: str, settings: Any, cancels: Any,
                 metrics: Any = None) -> None:
        self.redis = redis
        self.namespace = namespace
        self.grace_s = float(settings.resume_grace_s)
        self.ttl_ms = int(settings.resume_ttl_s * 1000)
        self.cancels = cancels
        self.metrics = metrics
        # (job id, token) -> (op, hold): one entry per connection, so the work owed for an
        # old connection never overwrites the one owed for the connection that replaced it
        self.owed: dict[tuple[str, str], tuple[str, Held]] = {}
        self.local: dict[str, Local] = {}
        self._wake = asyncio.Event()
        self._task: Optional[asyncio.Task] = None
        self._sweeper: Optional[asyncio.Task] = None

    def key(self, job_id: str) -> str:
        return stream_session_key(self.namespace, job_id)

    async def _script(self, script: LuaScript, key: str, *args: Any) -> Any:
        """EVALSHA, loading the script first when the server does not know it (SCRIPT LOAD,
        as the SDK's producers do: the producer ACL role has no EVAL)."""
        try:
            return await self.redis.evalsha(script.sha, 1, key, *args)
        except NoScriptError:
            await self.redis.script_load(script.source)
            return await self.redis.evalsha(script.sha, 1, key, *args)

    # -- a stream's life
    async def open(self, job_id: str, owner: str, digest: str, spec: StreamSpec) -> Held:
        """Write the record of a new stream, held by the calling connection."""
        held = Held(job_id, new_token(), spec)
        key = self.key(job_id)
        async with self.redis.pipeline(transaction=False) as pipe:    # one write, in order
            pipe.hset(key, mapping={"owner": owner, "digest": digest, "state": "live",
                                    "token": held.token, "spec": spec.model_dump_json()})
            pipe.pexpire(key, self.ttl_ms)
            await pipe.execute()
        return held

    async def claim(self, job_id: str, owner: str, digest: str) -> Held:
        """Take the stream for a resuming connection (APIError 403/404/400/410 when refused;
        a grace that ran out now cancels the job)."""
        token = new_token()
        try:
            reply = await self._script(CLAIM_STREAM, self.key(job_id), owner, token, digest)
        except RedisError as exc:
            raise api_error(exc) from None
        outcome = _text(reply[0])
        if outcome == "expired":
            self._cancel(job_id, StreamSpec.model_validate_json(reply[1]))
        if outcome != "claimed":
            raise claim_error(outcome, job_id, self.grace_s)
        if self.metrics is not None:
            self.metrics.resumes.inc()
        return Held(job_id, token, StreamSpec.model_validate_json(reply[2]))

    def attach(self, held: Held, feed: Any) -> None:
        """``feed`` reads the held stream on this gateway (until ``left``)."""
        self.local[held.job_id] = Local(held.token, feed)

    async def displace(self, job_id: str, wait_s: float) -> None:
        """Stop this gateway's connection that holds ``job_id`` (another connection claimed
        it) and wait until it let go; 409 when it does not within ``wait_s``."""
        prev = self.local.get(job_id)
        if prev is None:
            return
        prev.stop = True
        prev.feed.watch.notify()
        try:
            await asyncio.wait_for(prev.closed.wait(), wait_s)
        except asyncio.TimeoutError:
            raise APIError(409, f"the stream of job {job_id} is still being sent to another "
                           f"connection; retry in a moment", "invalid_request_error", None,
                           "stream_busy", {"Retry-After": "1"}) from None

    async def superseded(self, held: Held, every_s: float) -> bool:
        """Whether another connection resumed the held stream: at once when it did on this
        gateway, else asked of Redis at most once per ``every_s``."""
        local = self.local.get(held.job_id)
        if local is None or local.token != held.token:
            return False
        if local.stop:
            return True
        if time.monotonic() - local.checked < every_s:
            return False
        local.checked = time.monotonic()
        try:
            holder = await self.holder(held.job_id)
        except RedisError:
            return False
        return holder is not None and holder != held.token

    def left(self, held: Held, ended: bool, gave_up: bool = False) -> None:
        """The connection holding ``held`` is gone (returns at once). A job that ended: the
        record says so. One whose stream gave up (its request's time ran out, Redis was gone
        too long: the client got an error and ``[DONE]``) is cancelled at once, as is any with
        no grace (as before resumable streams); the record then says its grace ran out.
        Otherwise the stream is parked for the grace."""
        local = self.local.get(held.job_id)
        if local is not None and local.token == held.token:
            del self.local[held.job_id]
            local.closed.set()
        if ended:
            self._owe("end", held)
            return
        if self.grace_s <= 0 or gave_up:
            self._cancel(held.job_id, held.spec)
        self._owe("drop" if gave_up else "park", held)

    async def holder(self, job_id: str) -> Optional[str]:
        """The token of the connection holding a live stream (None: not live)."""
        state, token = await self.redis.hmget(self.key(job_id), ["state", "token"])
        return _text(token) if state is not None and _text(state) == "live" and token else None

    def _cancel(self, job_id: str, spec: StreamSpec) -> None:
        self.cancels.add(spec.cancel_target(self.namespace, job_id))
        if self.metrics is not None:
            self.metrics.cancelled.inc()

    # -- work owed, sent by one task
    def _owe(self, op: str, held: Held) -> None:
        self.owed[(held.job_id, held.token)] = (op, held)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name="tokenrelay-streams")
        self._wake.set()

    async def _run(self) -> None:
        pause = 0.05
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self.owed:
                if await self._send_some():
                    pause = 0.05
                    continue
                await asyncio.sleep(pause)
                pause = min(pause * 2, MAX_PAUSE_S)

    async def _send_some(self) -> bool:
        for owed, (op, held) in list(self.owed.items()):
            try:
                await (self._script(END_STREAM, self.key(held.job_id), self.ttl_ms)
                       if op == "end" else self._park(held, op == "drop"))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("stream %s: could not %s it yet (retrying): %s", held.job_id, op,
                            exc)
                return False
            del self.owed[owed]
        return True

    async def _park(self, held: Held, cancelled: bool) -> None:
        """Listed first (due when its grace ends), then parked: a gateway that dies between
        the two leaves a listed stream that is not parked, which the sweep drops. A job
        ``cancelled`` already is parked with no grace: a resume finds it ran out."""
        grace_ms = 0 if cancelled else int(self.grace_s * 1000)
        if grace_ms > 0:        # no grace: cancelled already, parked only for the record
            await self.redis.zadd(parked_streams_key(self.namespace),
                                  {held.job_id: time.time() * 1000 + grace_ms})
            self.start_sweeper()
        ends = await self._script(PARK_STREAM, self.key(held.job_id), held.token, grace_ms,
                                  self.ttl_ms)
        if ends == -1 and grace_ms > 0:     # its record expired: nobody can resume it
            self._cancel(held.job_id, held.spec)
        elif ends > 0 and grace_ms > 0 and self.metrics is not None:
            self.metrics.parked.inc()

    # -- the sweep
    def start_sweeper(self) -> None:
        """Sweep the parked streams of every gateway until ``close`` (started at the first
        request while a grace is set)."""
        if self.grace_s > 0 and (self._sweeper is None or self._sweeper.done()):
            self._sweeper = asyncio.get_running_loop().create_task(
                self._sweep_forever(), name="tokenrelay-stream-sweep")

    async def _sweep_forever(self) -> None:
        """Every quarter grace (a second at most); while Redis fails, backing off to
        ``MAX_PAUSE_S`` with one warning per failure streak, not one per round."""
        interval = max(0.05, min(1.0, self.grace_s / 4))
        pause = interval
        while True:
            try:
                await self.sweep()
                pause = interval
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if pause == interval:
                    log.warning("parked streams: sweep failed (retrying): %s", exc)
                pause = min(pause * 2, MAX_PAUSE_S)
            await asyncio.sleep(pause)

    async def sweep(self) -> int:
        """Expire the parked streams whose grace ended (by the gateway's clock; each one's
        script decides by Redis's); the number of jobs cancelled."""
        due = await self.redis.zrangebyscore(parked_streams_key(self.namespace), "-inf",
                                             time.time() * 1000, start=0, num=SWEEP_BATCH)
        cancelled = 0
        for raw in due:
            cancelled += await self._expire(_text(raw))
        return cancelled

    async def _expire(self, job_id: str) -> int:
        reply = await self._script(EXPIRE_PARKED, self.key(job_id))
        outcome = _text(reply[0])
        listed = parked_streams_key(self.namespace)
        if outcome == "wait":
            await self.redis.zadd(listed, {job_id: time.time() * 1000 + int(reply[1])}, xx=True)
            return 0
        if outcome == "cancel":
            self._cancel(job_id, StreamSpec.model_validate_json(reply[1]))
            log.info("stream %s: no client resumed it within %g s; its job is cancelled",
                     job_id, self.grace_s)
        await self.redis.zrem(listed, job_id)
        return int(outcome == "cancel")

    async def close(self) -> None:
        """Send what is owed once more; stop the tasks."""
        for task in (self._task, self._sweeper):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if self.owed:
            with contextlib.suppress(Exception):
                await self._send_some()
        if self.owed:
            log.error("gateway stopping with %d streams not parked or ended in Redis: %s",
                      len(self.owed), ", ".join(job for job, _ in list(self.owed)[:20]))


__all__ = ["Held", "Local", "Streams", "claim_error", "new_token"]
