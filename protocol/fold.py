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
* Choices: each token event belongs to one ``choice`` (0 unless ``n > 1`` or beam search)
  and is appended to that choice's output; ``seq`` stays one sequence for the whole job, so
  the duplicate rule above is unchanged. A token event carrying ``finish_reason`` ends its
  choice (``finish_reason``, ``stop_reason`` and ``cumulative_logprob`` are recorded).
* ``done`` of a job whose stream had no token event carries the whole output (``stream=False``):
  it is surfaced as one delta per choice (``choices[i].text``, or ``text`` for choice 0).
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

from tokenrelay.protocol.logprobs import TokenLogprob, TopLogprob
from tokenrelay.protocol.errors import ProtocolError, describe_validation_error
from tokenrelay.protocol.events import DoneEvent, ErrorEvent


def token_logprobs(token_ids: list[int], logprobs: Any,
                   names: Any) -> Optional[list[TokenLogprob]]:
    """Join what the wire carries per token -- the chosen id, its ``{token_id: logprob}`` map
    (the top alternatives and the chosen) and ``logprob_tokens`` (id -> [text, bytes]) -- into
    ``TokenLogprob`` records, alternatives best first. None without ``logprob_tokens`` (a
    writer from before it); ValueError when the event does not hold together."""
    if logprobs is None or names is None:
        return None
    if not isinstance(names, dict) or not isinstance(logprobs, list) \
            or len(logprobs) != len(token_ids):
        raise ValueError("logprobs, token_ids and logprob_tokens disagree")
    out = []
    for tid, top in zip(token_ids, logprobs):
        if not isinstance(top, dict) or tid not in top:
            raise ValueError(f"logprobs of token {tid} do not name it")
        alts = [TopLogprob.model_construct(token_id=t, logprob=float(lp), **_named(names, t))
                for t, lp in sorted(top.items(), key=lambda kv: -kv[1])]
        out.append(TokenLogprob.model_construct(token_id=tid, logprob=float(top[tid]),
                                                top_logprobs=alts, **_named(names, tid)))
    return out


def _named(names: dict, token_id: Any) -> dict[str, Any]:
    entry = names.get(token_id)
    if (type(token_id) is not int or not isinstance(entry, (list, tuple)) or len(entry) != 2
            or not isinstance(entry[0], str) or not isinstance(entry[1], bytes)):
        raise ValueError(f"logprob_tokens has no [text, bytes] for token {token_id!r}")
    return {"token": entry[0], "bytes": list(entry[1])}


@dataclass(frozen=True, slots=True)
class Delta:
    """New output of one engine step for one choice: ``text`` to append, its ``token_ids`` (and
    logprobs). ``index`` is the choice (as in OpenAI and vLLM), ``position`` the output position
    of its first token within that choice, ``seq`` the token event's number in the job.
    ``finish_reason`` is set on a choice's last delta."""

    text: str
    token_ids: list[int]
    logprobs: Optional[list[dict[int, float]]] = None
    index: int = 0
    seq: int = 0
    position: int = 0
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[str, int]] = None
    token_logprobs: Optional[list[TokenLogprob]] = None   # per token: its text, bytes, top


class ChoiceFold:
    """One choice's output so far."""

    __slots__ = ("parts", "token_ids", "logprobs", "token_logprobs", "finish_reason",
                 "stop_reason", "cumulative_logprob")

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: Optional[list[dict[int, float]]] = None
        self.token_logprobs: Optional[list[TokenLogprob]] = None
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[Union[str, int]] = None
        self.cumulative_logprob: Optional[float] = None

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def add_logprobs(self, logprobs: Optional[list], named: Optional[list[TokenLogprob]]) -> None:
        if logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(logprobs)
        if named is not None:
            if self.token_logprobs is None:
                self.token_logprobs = []
            self.token_logprobs.extend(named)


_NONE: tuple = ()
_EMPTY = ChoiceFold()   # what a choice nothing was folded of reads as (never written to)


class ResultFold:
    """Everything one result stream says so far (sans-IO; the rule is in the module docstring)."""

    __slots__ = ("job_id", "next_seq", "choices", "attempts", "seed", "terminal")

    def __init__(self, job_id: str = "") -> None:
        self.job_id = job_id
        self.next_seq = 0
        self.choices: dict[int, ChoiceFold] = {}
        self.attempts = 0
        self.seed: Optional[int] = None
        self.terminal: Optional[Union[DoneEvent, ErrorEvent]] = None

    @property
    def finished(self) -> bool:
        return self.terminal is not None

    def choice(self, index: int) -> ChoiceFold:
        """Choice ``index`` as folded so far (empty when nothing of it was folded)."""
        return self.choices.get(index, _EMPTY)

    # choice 0, which is the whole output of an n == 1 job
    @property
    def text(self) -> str:
        return self.choice(0).text

    @property
    def token_ids(self) -> list[int]:
        return self.choice(0).token_ids

    @property
    def logprobs(self) -> Optional[list[dict[int, float]]]:
        return self.choice(0).logprobs

    def apply_raw(self, raw: Any) -> tuple[Delta, ...]:
        """Apply one entry's ``data`` field (msgpack bytes); ProtocolError if it is not an event."""
        try:
            event = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated exception types
            raise self._error(f"result event is not msgpack ({type(exc).__name__})") from None
        if not isinstance(event, dict):
            raise self._error(f"result event is not a map: {event!r:.80}")
        return self.apply(event)

    def apply(self, event: Mapping[str, Any]) -> tuple[Delta, ...]:
        """Apply one decoded event; the new deltas it added (one, or several for the ``done``
        of a ``stream=False`` job with several choices)."""
        if self.terminal is not None:
            return _NONE
        kind = event.get("type")
        if kind == "token":
            return self._token(event)
        if kind == "started":
            self._started(event)
        elif kind in ("done", "error"):
            return self._finish(event)
        return _NONE

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

    def _token(self, event: Mapping[str, Any]) -> tuple[Delta, ...]:
        seq, choice, text = event.get("seq"), event.get("choice", 0), event.get("text")
        position = event.get("position", event.get("index", 0))   # "index": older v1 writers
        ids, lp = event.get("token_ids"), event.get("logprobs")
        reason, stop = event.get("finish_reason"), event.get("stop_reason")
        if (type(seq) is not int or type(choice) is not int or choice < 0
                or type(position) is not int or not isinstance(text, str)
                or not isinstance(ids, list) or any(type(t) is not int for t in ids)
                or not (lp is None or isinstance(lp, list))
                or not (reason is None or isinstance(reason, str))):
            raise self._error(f"malformed token event {dict(event)!r:.120}")
        if seq < self.next_seq:
            return _NONE
        named = self._named(ids, lp, event.get("logprob_tokens"), event)
        self.next_seq = seq + 1
        c = self.choices.get(choice)
        if c is None:
            c = self.choices[choice] = ChoiceFold()
        c.parts.append(text)
        c.token_ids.extend(ids)
        c.add_logprobs(lp, named)
        if reason is not None:
            c.finish_reason, c.stop_reason = reason, stop
            cum = event.get("cumulative_logprob")
            c.cumulative_logprob = cum if isinstance(cum, (int, float)) else None
        return (Delta(text, ids, lp, choice, seq, position, reason, stop, named),)

    def _named(self, ids: list[int], lp: Any, names: Any,
               event: Mapping[str, Any]) -> Optional[list[TokenLogprob]]:
        try:
            return token_logprobs(ids, lp, names)
        except ValueError as exc:
            raise self._error(f"malformed token event ({exc}) {dict(event)!r:.120}") from None

    def _finish(self, event: Mapping[str, Any]) -> tuple[Delta, ...]:
        model = DoneEvent if event["type"] == "done" else ErrorEvent
        try:
            self.terminal = model.model_validate(event)
        except ValidationError as exc:
            raise self._error(f"malformed {event['type']} event: "
                              f"{describe_validation_error(exc)}") from None
        t = self.terminal
        if not isinstance(t, DoneEvent) or self.next_seq != 0:
            return _NONE
        outputs = t.choices or [t]
        deltas = []
        for c in outputs:
            index = getattr(c, "index", 0)
            ids = list(c.token_ids or [])
            named = self._named(ids, c.logprobs, c.logprob_tokens, event)
            if c.logprobs is not None:   # the output of a stream=False job is all in done
                self.choices.setdefault(index, ChoiceFold()).add_logprobs(c.logprobs, named)
            if c.text:
                deltas.append(Delta(c.text, ids, c.logprobs, index, 0, 0, c.finish_reason,
                                    c.stop_reason, named))
        return tuple(deltas)
