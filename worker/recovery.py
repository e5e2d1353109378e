"""Resume-read: what a job's result stream says the client already has.

A worker that takes over a job (reclaimed from a dead worker, handed back by a draining one, or
re-read from its own pending list after a restart) must continue it, not restart it: the client
already holds some tokens and a restart would send them twice or, with sampling, different ones.
The result stream is the only truth about what was delivered, so this reads it back into the
engine's ``ResumeState`` inputs plus the recorded seed (sampling is a function of seed and
output position, so the same seed continues exactly).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

import redis

from producer_sdk.protocol import (EVENT_FIELD, DoneEvent, ErrorEvent, Event, Keys, ProtocolError,
                                   StartedEvent, TokenEvent, decode_event)


@dataclass
class JobProgress:
    """Summary of one result stream."""

    exists: bool = False
    attempts: int = 0                      # number of ``started`` events
    seed: Optional[int] = None             # seed of the latest ``started`` event that had one
    next_seq: int = 0                      # seq the next token event must carry
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    terminal: Optional[Event] = None       # the done/error event, if the job already ended
    last_entry_id: Optional[str] = None
    undecodable: int = 0                   # entries that were not protocol events (skipped)

    @property
    def finished(self) -> bool:
        return self.terminal is not None

    @property
    def last_seq(self) -> int:
        """seq of the last token event, -1 when there is none."""
        return self.next_seq - 1


def _field(fields: dict[Any, Any]) -> Optional[bytes]:
    return fields.get(EVENT_FIELD, fields.get(EVENT_FIELD.decode()))


def progress_from_entries(entries: Iterable[tuple[Any, dict[Any, Any]]]) -> JobProgress:
    """Fold XRANGE entries into a JobProgress. Duplicate or stale token events (seq already seen)
    are skipped so a reader's view and ours agree even if a stream was written twice."""
    prog = JobProgress()
    parts: list[str] = []
    for entry_id, fields in entries:
        prog.exists = True
        prog.last_entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        raw = _field(fields or {})
        try:
            event = decode_event(raw) if raw is not None else None
        except (ProtocolError, ValueError):
            event = None
        if event is None:
            prog.undecodable += 1
            continue
        if isinstance(event, StartedEvent):
            prog.attempts += 1
            if event.seed is not None:
                prog.seed = event.seed
        elif isinstance(event, TokenEvent):
            if event.seq < prog.next_seq:
                continue
            del prog.token_ids[event.index:]
            prog.token_ids.extend(event.token_ids)
            parts.append(event.text)
            prog.next_seq = event.seq + 1
        elif isinstance(event, (DoneEvent, ErrorEvent)) and prog.terminal is None:
            prog.terminal = event
    prog.text = "".join(parts)
    return prog


def read_progress(client: redis.Redis, keys: Keys, job_id: str, page: int = 1000) -> JobProgress:
    """Read a job's whole result stream (paged) into a JobProgress."""
    entries: list[tuple[Any, dict[Any, Any]]] = []
    start = "-"
    while True:
        batch = client.xrange(keys.results(job_id), min=start, count=page)
        entries.extend(batch)
        if len(batch) < page:
            break
        last = batch[-1][0]
        start = "(" + (last.decode() if isinstance(last, bytes) else last)
    return progress_from_entries(entries)
