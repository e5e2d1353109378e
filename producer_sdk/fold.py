"""The one reading of a job's result stream: ``ResultFold``.

The SDK's ``JobState`` (what a producer sees) and the worker's resume-read
(``worker/recovery.py``: what a worker taking over a job continues from) fold the same stream;
if they folded it differently a resumed job could show the client one text and continue the
engine from another. So both use this class, and the rule is written once:

* Events are applied in stream order; nothing after the first terminal event (``done`` or
  ``error``) counts (a late write of a fenced-out worker).
* ``started``: ``attempts`` becomes ``max(attempts + 1, event.attempt)``; ``seed`` becomes the
  event's seed when it has one (a resume must sample with the recorded seed).
* ``token``: ``seq`` is the event's identity. An event whose ``seq`` is below ``next_seq`` was
  already folded -- a retried write, a replayed entry, or an attempt that re-emits from its
  resume point (sampling is a function of seed and output position, so those tokens are the
  ones already folded) -- and is skipped whole. Any other token event is appended whole (text,
  token ids, logprobs) and ``next_seq`` becomes ``seq + 1``.
* The fold only ever appends. A reader that printed a delta never has to take it back, and the
  token ids and the text always describe the same events (the earlier resume-read cut token ids
  at ``index`` but kept the text, so the two could disagree).
* ``done`` of a job whose stream had no token event carries the whole output (``stream=False``):
  it is surfaced as one delta.
* Unknown event types are additive protocol changes and are ignored.

The fold works on decoded msgpack maps and validates token events by hand (a pydantic model per
token would cost more than the XREAD that brought it); terminal events become the protocol's
``DoneEvent`` / ``ErrorEvent`` models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import msgpack
from pydantic import ValidationError

from producer_sdk.protocol import DoneEvent, ErrorEvent, ProtocolError, describe_validation_error


@dataclass(frozen=True, slots=True)
class Delta:
    """New output of one engine step: ``text`` to append, its ``token_ids`` (and logprobs)."""

    text: str
    token_ids: list[int]
    logprobs: Optional[list[dict[int, float]]] = None
    index: int = 0
    seq: int = 0


class ResultFold:
    """Everything one result stream says so far (sans-IO; the rule is in the module docstring)."""

    __slots__ = ("job_id", "next_seq", "parts", "token_ids", "logprobs", "attempts", "seed",
                 "terminal")

    def __init__(self, job_id: str = "") -> None:
        self.job_id = job_id
        self.next_seq = 0
        self.parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: Optional[list[dict[int, float]]] = None
        self.attempts = 0
        self.seed: Optional[int] = None
        self.terminal: Optional[Union[DoneEvent, ErrorEvent]] = None

    @property
    def finished(self) -> bool:
        return self.terminal is not None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def apply_raw(self, raw: Any) -> Optional[Delta]:
        """Apply one entry's ``data`` field (msgpack bytes); ProtocolError if it is not an event."""
        try:
            event = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated exception types
            raise self._error(f"result event is not msgpack ({type(exc).__name__})") from None
        if not isinstance(event, dict):
            raise self._error(f"result event is not a map: {event!r:.80}")
        return self.apply(event)

    def apply(self, event: Mapping[str, Any]) -> Optional[Delta]:
        """Apply one decoded event; the new delta, if it added output."""
        if self.terminal is not None:
            return None
        kind = event.get("type")
        if kind == "token":
            return self._token(event)
        if kind == "started":
            self._started(event)
        elif kind in ("done", "error"):
            return self._finish(event)
        return None

    def _error(self, message: str) -> ProtocolError:
        prefix = f"job {self.job_id}: " if self.job_id else ""
        return ProtocolError(prefix + message, job_id=self.job_id or None)

    def _started(self, event: Mapping[str, Any]) -> None:
        attempt = event.get("attempt", 1)
        seed = event.get("seed")
        if type(attempt) is not int or (seed is not None and type(seed) is not int):
            raise self._error(f"malformed started event {dict(event)!r:.120}")
        self.attempts = max(self.attempts + 1, attempt)
        if seed is not None:
            self.seed = seed

    def _token(self, event: Mapping[str, Any]) -> Optional[Delta]:
        seq, index, text = event.get("seq"), event.get("index", 0), event.get("text")
        ids, lp = event.get("token_ids"), event.get("logprobs")
        if (type(seq) is not int or type(index) is not int or not isinstance(text, str)
                or not isinstance(ids, list) or any(type(t) is not int for t in ids)
                or not (lp is None or isinstance(lp, list))):
            raise self._error(f"malformed token event {dict(event)!r:.120}")
        if seq < self.next_seq:
            return None
        self.next_seq = seq + 1
        self.parts.append(text)
        self.token_ids.extend(ids)
        if lp is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(lp)
        return Delta(text, ids, lp, index, seq)

    def _finish(self, event: Mapping[str, Any]) -> Optional[Delta]:
        model = DoneEvent if event["type"] == "done" else ErrorEvent
        try:
            self.terminal = model.model_validate(event)
        except ValidationError as exc:
            raise self._error(f"malformed {event['type']} event: "
                              f"{describe_validation_error(exc)}") from None
        t = self.terminal
        if isinstance(t, DoneEvent) and t.text and self.next_seq == 0:
            return Delta(t.text, list(t.token_ids or []), None, 0, 0)
        return None
