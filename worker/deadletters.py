"""The one dead-letter writer: a job the workers give up on is copied to ``Keys.dead(shard)`` of
the shard whose stream held its entry (beside the job's keys, in one script) and, when
its job id can be read, its client gets a terminal ``error`` event.

Every path (invalid payload, duplicate job id, poison past --max-deliveries, an engine failure
on the last allowed delivery, a result stream that cannot be written) goes through
``DeadLetterWriter.queue``: the stored payload is cut to --dead-letter-payload-bytes (``size``
and ``truncated`` say so), the stream is capped at about --dead-letter-maxlen entries, and the
error event is written by the DEAD_LETTER script only when the job id is bound to this entry
(never into another live job's stream) and the stream has not already ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from tokenrelay.protocol.errors import ProtocolError
from tokenrelay.protocol.events import ErrorEvent, encode_event
from tokenrelay.protocol.keys import Keys, dedupe_record
from tokenrelay.protocol.wire import DeadLetter, decode_job
from tokenrelay.protocol.scripts import DEAD_LETTER, ScriptPipeline, text
from tokenrelay.worker.entries import Entry


@dataclass
class Rejection:
    """An entry to dead-letter (and ack once that landed)."""

    entry: Entry
    code: str
    message: str
    job_id: Optional[str] = None
    metadata: dict = field(default_factory=dict)


def payload_job_id(payload: Optional[bytes]) -> Optional[str]:
    """The job id of a payload, also when the rest of it does not validate."""
    if not payload:
        return None
    try:
        return decode_job(payload).job_id
    except ProtocolError as exc:
        return exc.job_id
    except Exception:  # a decoder bug: the letter is still written, without a job id
        return None


class DeadLetterWriter:
    """Queues dead letters (plus the job's error event) on a ScriptPipeline."""

    def __init__(self, keys: Keys, worker_id: str, ttl_ms: int, dedupe_ttl_s: int,
                 maxlen: int, payload_bytes: int) -> None:
        self.keys = keys
        self.worker_id = worker_id
        self.ttl_ms = int(ttl_ms)
        self.dedupe_ttl_s = int(dedupe_ttl_s)
        self.maxlen = int(maxlen)
        self.payload_bytes = int(payload_bytes)

    def letter(self, r: Rejection) -> DeadLetter:
        data = r.entry.payload or b""
        return DeadLetter(data=data[:self.payload_bytes], size=len(data),
                          truncated=len(data) > self.payload_bytes, reason=r.message,
                          code=r.code, worker_id=self.worker_id, lane=r.entry.lane_key,
                          entry_id=r.entry.entry_id, job_id=r.job_id or "",
                          deliveries=r.entry.deliveries)

    def queue(self, pipe: ScriptPipeline, r: Rejection) -> int:
        """One DEAD_LETTER call; its reply is 'written', 'ended', 'other', 'nojob' or an
        error (retry the whole rejection: the letter may then be stored twice, never lost)."""
        shard = r.entry.shard   # the letter and the job's keys: the entry's shard's slot
        keys = [self.keys.dead(shard)]
        event = b""
        if r.job_id:
            keys += [self.keys.dedupe(r.job_id, shard), self.keys.owner(r.job_id, shard),
                     self.keys.results(r.job_id, shard), self.keys.budget(shard)]
            event = encode_event(ErrorEvent(code=r.code, message=r.message, metadata=r.metadata))
        flat = [x for k, v in self.letter(r).to_fields().items() for x in (k, v)]
        return pipe.script(DEAD_LETTER, keys, [
            self.maxlen, dedupe_record(r.entry.lane_key, r.entry.entry_id),
            f"{self.worker_id}:dead-letter", self.ttl_ms, self.dedupe_ttl_s, event,
            r.entry.cost, *flat])


def outcome(reply: Any) -> str:
    """'written' | 'ended' | 'other' | 'nojob' of a DEAD_LETTER reply."""
    return text(reply)
