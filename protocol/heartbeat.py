"""The worker heartbeat: the hash ``Keys.heartbeat(worker_id)``, written by the worker every
``--heartbeat-ms`` (worker/liveness.py) and read by everyone else: the health probe
(worker/health.py), ``admin workers`` (worker/admin.py), the affinity sweep of other workers'
streams (worker/affinity.py), the producers' affinity router (producer_sdk/core/affinity.py) and the
model listing behind ``/v1/models`` and batch routing (producer_sdk/core/models.py).

One schema, so a field is named in one place: ``Heartbeat`` says what each field holds, how it
is written (``encode``: integers and ``0``/``1`` flags, as ``HSET`` stores them) and how it is
read back (``decode`` for ``HGETALL``, ``from_row`` for ``HMGET`` of ``FIELDS``). Reading is
lenient: a field that is absent or unreadable reads as its default (0, "", False), so a worker
of an older or newer version, or a hand-edited hash, never breaks a reader. A flag is set only
when it reads ``1``.

``instance`` (``host:pid:token`` of the process that holds the worker id) is written only by the
id lease script (``protocol.scripts.ID_CLAIM``), never by ``encode``: the lease and the beat are
two writers of one hash, and the lease's field must not be overwritten by a beat.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Generator, Mapping, Optional, Sequence, Union

from tokenrelay.protocol.keys import Keys

INSTANCE_FIELD = "instance"


@dataclass(frozen=True)
class Heartbeat:
    """One worker's last beat (docs/protocol.md, "Workers: heartbeat, delivery, ownership")."""

    ts: int = 0                  # epoch ms of the beat
    instance: str = ""           # host:pid:token holding the worker id (the id lease writes it)
    pid: int = 0
    host: str = ""
    queue: str = ""
    model: str = ""              # the checkpoint path (--model)
    served_model_name: str = ""  # what a request's model must say to reach this queue
    started_ms: int = 0          # epoch ms the worker started
    engine_loaded: bool = False  # False once an engine step failed (the worker is exiting)
    draining: bool = False
    held: int = 0                # jobs the worker holds
    running: int = 0             # the engine's running and waiting sequences
    waiting: int = 0
    redis_error: str = ""        # the transient Redis error being waited out, if any
    affinity: bool = False       # reads its affinity streams (producers may route to it)
    affinity_queued: int = 0     # entries unread in its affinity streams
    tool_format: str = ""        # what its chat template does with tools (protocol/tools.py):
                                 # hermes, unparsed, none; "" when unknown (an older worker)

    def encode(self) -> dict[str, Union[int, str]]:
        """The fields for ``HSET`` (every one but ``instance``, which the id lease writes)."""
        return {f.name: _encode(getattr(self, f.name)) for f in _FIELDS
                if f.name != INSTANCE_FIELD}

    @classmethod
    def decode(cls, mapping: Mapping[Any, Any]) -> "Heartbeat":
        """From an ``HGETALL`` reply (keys and values as bytes or str)."""
        text = {_text(k): v for k, v in mapping.items()}
        return cls(**{f.name: _decode(f.type, text.get(f.name)) for f in _FIELDS})

    @classmethod
    def from_row(cls, row: Optional[Sequence[Any]]) -> Optional["Heartbeat"]:
        """From an ``HMGET`` of ``FIELDS``; None when the hash does not exist (every value
        nil), i.e. the worker is dead or exited."""
        if not row or all(v is None for v in row):
            return None
        return cls(**{f.name: _decode(f.type, v) for f, v in zip(_FIELDS, row)})

    def serving(self, queue: str) -> bool:
        """Whether this worker takes new jobs of ``queue``: it names that queue, its engine is
        loaded and it is not draining (what the model listing and the affinity router call
        live; the hash existing at all is the caller's ``from_row`` not returning None)."""
        return self.queue == queue and self.engine_loaded and not self.draining


_FIELDS = dataclasses.fields(Heartbeat)
FIELDS: tuple[str, ...] = tuple(f.name for f in _FIELDS)
assert INSTANCE_FIELD in FIELDS


Pipeline = list[tuple[Any, ...]]   # Redis commands to send together


def live_beats(namespace: str, queue: str
               ) -> Generator[Pipeline, list[Any], dict[str, Heartbeat]]:
    """Worker id -> heartbeat of ``queue``'s live workers (``Heartbeat.serving``), as a sans-IO
    plan (yields each round trip's commands, receives its replies): the queue's registry, then
    every registered worker's heartbeat. Producers run it to route (producer_sdk/core/models.py); a
    starting worker runs it to find the model its queue is served with (worker/model_guard.py)."""
    keys = Keys(namespace, queue)
    (ids,) = yield [("ZRANGE", keys.workers, 0, -1)]
    workers = sorted(_text(w) for w in ids or ())
    if not workers:
        return {}
    rows = yield [("HMGET", keys.heartbeat(w), *FIELDS) for w in workers]
    return {w: beat for w, row in zip(workers, rows)
            if (beat := Heartbeat.from_row(row)) is not None and beat.serving(queue)}


def queue_model(beats: Mapping[str, Heartbeat]) -> Optional[str]:
    """The model a queue is served with, given its live workers' beats (worker id -> beat):
    that of its longest-running worker (earliest ``started_ms``, then lowest id). One model per
    queue: a worker that started later with another model refuses to serve
    (worker/model_guard.py), and the model listing never routes to a queue for the loser's
    model in the moment before it exits (producer_sdk/core/models.py). None: no live worker says."""
    named = {w: b for w, b in beats.items() if b.served_model_name}
    if not named:
        return None
    first = min(named, key=lambda w: (named[w].started_ms, w))
    return named[first].served_model_name


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)


def _encode(value: Any) -> Union[int, str]:
    return int(value) if isinstance(value, bool) else value


def _decode(kind: Any, raw: Any) -> Any:
    """One field's value; its default when absent or unreadable. ``kind`` is the annotation as
    written above (a string: this module uses postponed annotations)."""
    if kind == "bool":
        return raw is not None and _text(raw) == "1"
    if kind == "int":
        try:
            return int(_text(raw)) if raw is not None else 0
        except ValueError:
            return 0
    return "" if raw is None else _text(raw)


__all__ = ["Heartbeat", "FIELDS", "INSTANCE_FIELD", "live_beats", "queue_model"]
