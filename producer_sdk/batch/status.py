"""``tokenrelay status --batch INPUT``: where every request of a batch stands.

Job ids are derived from the batch id and each line's custom_id (``batch_lines.job_id_for``),
so the input file alone finds every job. Each custom_id is counted once (a repeated one is the
runner's ``duplicate_custom_id`` error line, not a second job), and the lines the runner
cannot run are named with their line number and why, rather than shown as "unknown" jobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenrelay.producer_sdk.batch.runner import load_line, parse_line
from tokenrelay.producer_sdk.errors import LineError
from tokenrelay.protocol.keys import Keys


@dataclass
class BatchLines:
    """What an input file holds: its custom_ids, each once, in file order, and the lines that
    are no request (line number, why)."""

    custom_ids: list[str] = field(default_factory=list)
    malformed: list[tuple[int, str]] = field(default_factory=list)


def read_batch_lines(path: Path) -> BatchLines:
    """Every line checked as the batch runner checks it before routing (JSON, BOM accepted,
    the request shape, ``body.model``), custom_ids deduplicated."""
    out = BatchLines()
    first: dict[str, int] = {}
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                tag, _ = parse_line(load_line(raw, lineno), lineno)
            except LineError as exc:
                out.malformed.append((lineno, f"{exc.code}: {exc.message}"))
                continue
            if tag.custom_id in first:
                out.malformed.append((lineno, f"duplicate_custom_id: repeats custom_id "
                                              f"{tag.custom_id!r} of line {first[tag.custom_id]}"))
                continue
            first[tag.custom_id] = lineno
            out.custom_ids.append(tag.custom_id)
    return out


def statuses_anywhere(client: Any, job_ids: list[str]) -> list[Any]:
    """Statuses of jobs that may be on any queue of the namespace (a batch routes each line
    to the queue of its model, and per-job keys are per queue): the client's queue first,
    then every queue workers serve, for the ids still unknown."""
    found = client.statuses(job_ids)
    others = sorted(q.decode() if isinstance(q, bytes) else str(q)
                    for q in client.redis.smembers(Keys(client.namespace).queues))
    for queue in (q for q in others if q != client.queue):
        missing = [i for i, st in enumerate(found) if st.state == "unknown"]
        if not missing:
            break
        for i, st in zip(missing, client.statuses([job_ids[i] for i in missing], queue)):
            found[i] = st
    return found


__all__ = ["BatchLines", "read_batch_lines", "statuses_anywhere"]
