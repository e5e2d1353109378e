"""Resume-read: what a job's result stream says the client already has.

A worker that takes over a job (reclaimed from a dead worker, handed back by a draining one, or
re-read from its own pending list after a restart) must continue it, not restart it: the client
already holds some tokens and a restart would send them twice or, with sampling, different ones.
The result stream is the only truth about what was delivered, so admission reads it (one
XRANGE in its start pipeline) and this folds it into the engine's ``ResumeState`` inputs plus
the recorded seed (sampling is a function of seed and output position, so the same seed
continues exactly).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from tokenrelay.protocol.fold import ChoiceFold, ResultFold
from tokenrelay.protocol.errors import ProtocolError
from tokenrelay.protocol.events import Event
from tokenrelay.protocol.keys import EVENT_FIELD


@dataclass
class JobProgress:
    """Summary of one result stream."""

    exists: bool = False
    attempts: int = 0                      # attempts so far (``started`` events, see ResultFold)
    seed: Optional[int] = None             # seed of the latest ``started`` event that had one
    next_seq: int = 0                      # seq the next token event must carry
    token_ids: list[int] = field(default_factory=list)   # choice 0 (all of an n == 1 job)
    text: str = ""
    choices: dict[int, ChoiceFold] = field(default_factory=dict)   # every choice, by index
    terminal: Optional[Event] = None       # the done/error event, if the job already ended
    last_entry_id: Optional[str] = None
    entries: int = 0                       # entries read, undecodable ones too (the stream's XLEN)
    undecodable: int = 0                   # entries that were not protocol events (skipped)

    @property
    def finished(self) -> bool:
        return self.terminal is not None

    @property
    def last_seq(self) -> int:
        """seq of the last token event, -1 when there is none."""
        return self.next_seq - 1


def progress_from_entries(entries: Iterable[tuple[Any, dict[Any, Any]]]) -> JobProgress:
    """Fold XRANGE entries into a JobProgress with the protocol's ``ResultFold``, the same rule
    the SDK's readers use, so what a resumed job continues from is what its client holds.
    Entries that are not protocol events are counted in ``undecodable`` and skipped."""
    prog = JobProgress()
    fold = ResultFold()
    for entry_id, fields in entries:
        prog.exists = True
        prog.entries += 1
        prog.last_entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        raw = (fields or {}).get(EVENT_FIELD, (fields or {}).get(EVENT_FIELD.decode()))
        try:
            if raw is None:
                raise ProtocolError("entry without an event field")
            fold.apply_raw(raw)
        except ProtocolError:
            prog.undecodable += 1
    prog.attempts, prog.seed, prog.next_seq = fold.attempts, fold.seed, fold.next_seq
    prog.token_ids, prog.text, prog.terminal = fold.token_ids, fold.text, fold.terminal
    prog.choices = fold.choices
    return prog
