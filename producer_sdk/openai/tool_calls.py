"""Tool calls: what a request's ``tools`` / ``tool_choice`` ask for, and the calls read back out
of the answer's text -- streamed as OpenAI streams tool-call deltas, or whole.

A request with tools becomes a job in one of three ways (``ToolPlan.choice``):

* ``required``: the answer is constrained (``params.structured_outputs``) to a JSON array of
  calls ``[{"name": ..., "arguments": {...}}, ...]`` (``protocol.tools.call_schema``);
* ``function`` (a named function): the answer is constrained to that function's arguments;
* ``auto``: the model's chat template describes the tools (the job's ``tools``) and the model
  answers in text or calls them in its own format; the ``hermes`` format
  (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``: Qwen2/2.5/3, Hermes 2/3 and
  the templates that copy them) is the one read here.

``CallReader`` reads one choice's text character by character, so what it finds does not
depend on how the text was split into deltas: a streamed answer and a whole one carry the same
content and the same calls. Call ids (``call_<24 hex>``) are derived from the job id, the choice
and the call's index, so a stream resumed after a worker died, or a batch line written again,
names the same calls.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

from tokenrelay.producer_sdk.openai.format import choice_body, chunk_choice
from tokenrelay.producer_sdk.openai.structured import ToolPlan

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_WS = " \t\n\r"


def call_id(job_id: str, choice: int, index: int) -> str:
    """OpenAI-shaped (``call_`` and 24 hex digits), the same for the same call every time."""
    digest = hashlib.blake2b(f"{job_id}\0{choice}\0{index}".encode(), digest_size=12)
    return "call_" + digest.hexdigest()


@dataclass(slots=True)
class Event:
    """``content`` (text outside calls), ``call`` (a call begins: ``text`` is its function's
    name) or ``args`` (a fragment of call ``index``'s arguments)."""

    kind: str
    text: str
    index: int = 0


class _Held:
    """Text passed on with its whitespace held back until more text follows, so whitespace at
    the end of a value (or before a call) is never sent; ``lead`` drops leading whitespace."""

    def __init__(self, lead: bool = False) -> None:
        self.ws = ""
        self.lead = lead
        self.started = False

    def add(self, ch: str) -> str:
        if ch in _WS:
            if self.started or not self.lead:
                self.ws += ch
            return ""
        self.started = True
        out, self.ws = self.ws + ch, ""
        return out


class _CallObject:
    """One ``{"name": ..., "arguments": ...}`` JSON object, scanned a character at a time: the
    call event once the name's string is complete, then the arguments' raw JSON text as it
    grows (arguments written before the name are held until the name comes)."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_str = self.esc = False
        self.phase = "key"                # key -> colon -> value -> (",") key ...
        self.key: list[str] = []
        self.current: Optional[str] = None
        self.value: list[str] = []
        self.held = _Held(lead=True)
        self.name: Optional[str] = None
        self.early_args: list[str] = []
        self.done = False

    def feed(self, ch: str) -> Iterator[Event]:
        top = self.depth == 1 and not self.in_str
        self._track(ch)
        if top and self.depth == 0:                      # the object's closing brace
            yield from self._end_value()
            self.done = True
        elif self.phase == "key":
            self._key_char(ch, top)
        elif self.phase == "colon":
            if top and ch == ":":
                self.phase, self.value, self.held = "value", [], _Held(lead=True)
        elif top and ch == ",":
            yield from self._end_value()
            self.phase = "key"
        else:
            yield from self._value_char(ch)

    def _track(self, ch: str) -> None:
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
        elif ch == '"':
            self.in_str = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1

    def _key_char(self, ch: str, top: bool) -> None:
        if top and ch == '"':
            self.key = [ch]
        elif self.key:
            self.key.append(ch)
            if not self.in_str:                          # the key's closing quote
                self.current, self.key, self.phase = _loads("".join(self.key)), [], "colon"

    def _value_char(self, ch: str) -> Iterator[Event]:
        if self.current == "name":
            self.value.append(ch)
        elif self.current == "arguments":
            piece = self.held.add(ch)
            if piece and self.name is None:
                self.early_args.append(piece)
            elif piece:
                yield Event("args", piece)

    def _end_value(self) -> Iterator[Event]:
        if self.current == "name" and self.name is None:
            name = _loads("".join(self.value).strip())
            if isinstance(name, str) and name:
                self.name = name
                yield Event("call", name)
                if self.early_args:
                    yield Event("args", "".join(self.early_args))
        self.current = None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _partial_tag(text: str) -> int:
    """How many characters at the end of ``text`` could begin ``<tool_call>``."""
    for n in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0


class CallReader:
    """One choice's content and calls, read incrementally from its text. ``feed(text)`` and,
    at the end, ``finish()`` return the new events; ``calls`` (``{"name", "arguments"}`` in
    call order) and ``content`` hold everything found so far."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.calls: list[dict[str, str]] = []
        self.content: list[str] = []
        self._started = 0               # calls begun (past max_calls included)
        self._obj: Optional[_CallObject] = None
        self._held = _Held(lead=plan.choice == "function")
        self._buf = ""                  # hermes: text that may be the start of a tag
        self._region = ""               # hermes: the raw text of the open tag region
        self._inside = False
        self._array = False             # required: inside the JSON array

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        for ch in text:
            out.extend(self._char(ch))
        return self._record(out)

    def finish(self) -> list[Event]:
        """The end of the answer: an open region that never named a function, and a partial
        tag, are content; held whitespace is content unless the answer called a function."""
        out: list[Event] = []
        if self.plan.choice == "auto":
            if self._inside and (self._obj is None or self._obj.name is None):
                out.append(Event("content", self._region))
            tail = self._held.ws if not self._started else ""
            out.append(Event("content", tail + self._buf))
            self._buf = self._region = ""
            self._inside = False
        self._held.ws = ""
        return self._record([e for e in out if e.text])

    def _record(self, events: list[Event]) -> list[Event]:
        for e in events:
            if e.kind == "content":
                self.content.append(e.text)
            elif e.kind == "call":
                self.calls.append({"name": e.text, "arguments": ""})
            else:
                self.calls[e.index]["arguments"] += e.text
        return events

    def _char(self, ch: str) -> Iterator[Event]:
        if self.plan.choice == "function":
            if not self._started:
                yield from self._numbered([Event("call", self.plan.function or "")])
            piece = self._held.add(ch)
            if piece:
                yield from self._numbered([Event("args", piece)])
        elif self.plan.choice == "required":
            yield from self._array_char(ch)
        elif self._inside:
            yield from self._region_char(ch)
        else:
            yield from self._outside_char(ch)

    def _numbered(self, events: Iterable[Event]) -> Iterator[Event]:
        """Each event with its call's index; none of a call past ``parallel_tool_calls``."""
        for e in events:
            if e.kind == "call":
                self._started += 1
            e.index = self._started - 1
            if self.plan.parallel or e.index == 0:
                yield e

    def _array_char(self, ch: str) -> Iterator[Event]:
        if self._obj is None and ch == "{" and self._array:
            self._obj = _CallObject()
        if self._obj is not None:
            yield from self._numbered(self._obj.feed(ch))
            if self._obj.done:
                self._obj = None
        elif ch == "[":
            self._array = True

    def _outside_char(self, ch: str) -> Iterator[Event]:
        """Hermes, outside a call: content, except what may begin ``<tool_call>``."""
        self._buf += ch
        if self._buf.endswith(TOOL_CALL_OPEN):
            yield from self._content(self._buf[:-len(TOOL_CALL_OPEN)])
            self._held.ws = ""                       # whitespace before a call: dropped
            self._buf, self._region, self._inside, self._obj = "", TOOL_CALL_OPEN, True, None
            return
        keep = _partial_tag(self._buf)
        yield from self._content(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]

    def _content(self, text: str) -> Iterator[Event]:
        for ch in text:
            piece = self._held.add(ch)
            if piece:
                yield Event("content", piece)

    def _region_char(self, ch: str) -> Iterator[Event]:
        """Hermes, inside ``<tool_call>``: one call object, then the closing tag."""
        self._region += ch
        if self._obj is None and ch == "{":
            self._obj = _CallObject()
        if self._obj is not None and not self._obj.done:
            yield from self._numbered(self._obj.feed(ch))
        elif self._region.endswith(TOOL_CALL_CLOSE):
            if self._obj is None or self._obj.name is None:
                yield Event("content", self._region)     # not a call after all: text
            self._inside, self._obj, self._region = False, None, ""
            self._held = _Held()


# --------------------------------------------------------------------------------------------
# Responses: chunk deltas and whole messages with tool_calls
# --------------------------------------------------------------------------------------------

def finish_reason(reader: CallReader, reason: Optional[str]) -> Optional[str]:
    """``tool_calls`` for an answer that ended (``stop``) having called a function."""
    return "tool_calls" if reason == "stop" and reader.calls else reason


def relay(reader: CallReader, job_id: str, index: int, text: str,
          logprobs: Optional[dict[str, Any]], reason: Optional[str]) -> list[dict[str, Any]]:
    """The chat chunk choices relaying one delta of choice ``index`` (none when it adds
    nothing): content, tool-call deltas (the first of a call with its id, type and name, then
    argument fragments) and, on the choice's last delta, its finish_reason."""
    events = reader.feed(text) + (reader.finish() if reason is not None else [])
    content = "".join(e.text for e in events if e.kind == "content")
    calls: list[dict[str, Any]] = []
    for e in events:
        if e.kind == "call":
            calls.append({"index": e.index, "id": call_id(job_id, index, e.index),
                          "type": "function", "function": {"name": e.text, "arguments": ""}})
        elif e.kind == "args" and calls and calls[-1]["index"] == e.index:
            calls[-1]["function"]["arguments"] += e.text
        elif e.kind == "args":
            calls.append({"index": e.index, "function": {"arguments": e.text}})
    if not (content or calls or logprobs or reason):
        return []
    return [chunk_choice(True, index, content or None, logprobs,
                         finish_reason(reader, reason), tool_calls=calls or None)]


def message_calls(reader: CallReader, job_id: str, index: int) -> list[dict[str, Any]]:
    return [{"id": call_id(job_id, index, i), "type": "function",
             "function": {"name": c["name"], "arguments": c["arguments"]}}
            for i, c in enumerate(reader.calls)]


def whole_choice(plan: ToolPlan, job_id: str, index: int, text: str,
                 logprobs: Optional[dict[str, Any]], reason: Optional[str]) -> dict[str, Any]:
    """One choice of a whole chat response: the content outside calls (None when there is
    none, or the answer was a forced call) and ``tool_calls``."""
    reader = CallReader(plan)
    reader.feed(text)
    reader.finish()
    content: Optional[str] = "".join(reader.content)
    if not content and (reader.calls or plan.choice != "auto"):
        content = None
    return choice_body(True, index, content, logprobs, finish_reason(reader, reason),
                       tool_calls=message_calls(reader, job_id, index) or None)


__all__ = ["ToolPlan", "CallReader", "Event", "call_id", "relay", "whole_choice",
           "finish_reason", "TOOL_CALL_OPEN", "TOOL_CALL_CLOSE"]
