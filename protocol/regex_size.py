"""A static estimate of how many lexer states a regex constraint can make a worker build,
read from the pattern alone, in time linear in its length (no compile, no vocabulary).

Why: llguidance's lexer builds a regex's states lazily, as the answer grows, so some
constraints compile in milliseconds and fail only tens of tokens into an answer, at a worker,
after holding its compile and mask time. ``(\\w+\\s?){1,1000}`` (an ordinary "up to 1,000
words") is the case in point: the submit-time probe (``grammar_probe``) would need about 8 s of
lexer work to see it fail (issue #42). What makes it explode can be read off the pattern: a
counted repetition whose body can both go on and start again on the same character (``\\w``
continues a word or, since ``\\s?`` may be empty, starts the next one), so the lexer must track
every count it could be at: about n states of n alternatives each. A body that cannot be read
two ways (``(\\w+\\s){1,1000}``: a word ends only at its space) needs about n.

The estimate (``expansion``), per construct:

- a character or class: 1; a sequence or an alternation: the sum of its parts;
- ``R{m,n}``: ``n * size(R)``, or ``n * n * size(R)`` when ``R`` is ambiguous as above (a
  character in both the set that starts ``R`` and the set that extends a complete match of
  ``R``), or when ``R`` matches the empty string; ``R{m,}``, ``R*``, ``R+``: ``(m + 1) * size(R)``
  (a loop, no count to track).

Character sets are tracked over bytes (non-ASCII characters share one member), which is
enough to tell ``\\w`` from ``\\s``. A pattern this reader does not understand gets no estimate
(None): llguidance's own check judges it.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Optional

_OTHER = 1 << 256                      # every non-ASCII character
_ALL = (1 << 257) - 1
# Sizes stop growing here: far past any limit, and nested counts cannot build huge integers.
CAP = 10**15


def _chars(text: str) -> int:
    bits = 0
    for c in text:
        bits |= 1 << ord(c) if ord(c) < 256 else _OTHER
    return bits


_DIGIT = _chars(string.digits)
_WORD = _chars(string.ascii_letters + string.digits + "_") | _OTHER
_SPACE = _chars(" \t\n\r\f\v")
_CLASSES = {"d": _DIGIT, "w": _WORD, "s": _SPACE, "D": _ALL & ~_DIGIT, "W": _ALL & ~_WORD,
            "S": _ALL & ~_SPACE}
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "0": "\0"}
_ZERO_WIDTH = frozenset("bBAzZG<>")


class Unreadable(ValueError):
    """The pattern uses syntax this estimate does not read (llguidance's check judges it)."""


@dataclass(frozen=True)
class Piece:
    """What the estimate knows of a sub-pattern: its size, whether it matches "", the
    characters that can start it, and those that can extend one of its complete matches."""

    size: int
    nullable: bool
    first: int
    cont: int


EMPTY = Piece(0, True, 0, 0)


def atom(chars: int) -> Piece:
    return Piece(1, False, chars, 0)


def then(a: Piece, b: Piece) -> Piece:
    """``a`` followed by ``b``."""
    cont = b.cont | (a.cont | b.first if b.nullable else 0)
    return Piece(min(CAP, a.size + b.size), a.nullable and b.nullable,
                 a.first | (b.first if a.nullable else 0), cont)


def either(a: Piece, b: Piece) -> Piece:
    return Piece(min(CAP, a.size + b.size), a.nullable or b.nullable, a.first | b.first,
                 a.cont | b.cont)


def repeat(r: Piece, low: int, high: Optional[int]) -> Piece:
    """``r{low,high}`` (``high`` None: unbounded)."""
    again = high is None or high > low          # a complete match may take one more round
    cont = r.cont | (r.first if again else 0)
    nullable = low == 0 or r.nullable
    if high is None:
        return Piece(min(CAP, (low + 1) * r.size), nullable, r.first, cont)
    ambiguous = r.nullable or bool(r.first & r.cont)
    size = high * high * r.size if ambiguous and high > 1 else high * r.size
    return Piece(min(CAP, size), nullable, r.first, cont)


def expansion(pattern: str) -> Optional[int]:
    """The estimated lexer states of ``pattern`` (see the module docstring); None when the
    pattern uses syntax this reader does not know."""
    try:
        return _Reader(pattern).read().size
    except Unreadable:
        return None


class _Reader:
    """One left-to-right pass with an explicit stack of open groups (no recursion: a pattern
    of thousands of nested groups costs memory, not the interpreter's stack)."""

    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.i = 0
        # per open group: (finished alternatives, the current sequence)
        self.stack: list[tuple[list[Piece], Piece]] = []
        self.alts: list[Piece] = []
        self.seq = EMPTY
        self.last: Optional[Piece] = None       # the atom a quantifier applies to

    def read(self) -> Piece:
        while self.i < len(self.p):
            self._step(self.p[self.i])
        if self.stack:
            raise Unreadable("unbalanced parenthesis")
        return self._close_alternatives()

    def _step(self, c: str) -> None:
        self.i += 1
        if c == "(":
            self._open_group()
        elif c == ")":
            self._close_group()
        elif c == "|":
            self._push_last()
            self.alts.append(self.seq)
            self.seq = EMPTY
        elif c in "*+?{":
            self._quantify(c)
        elif c in "^$":
            self._push_last()
        elif c == ".":
            self._atom(atom(_ALL & ~_chars("\n")))
        elif c == "[":
            self._atom(atom(self._class()))
        elif c == "\\":
            self._escape()
        else:
            self._atom(atom(_chars(c)))

    def _atom(self, piece: Piece) -> None:
        self._push_last()
        self.last = piece

    def _push_last(self) -> None:
        if self.last is not None:
            self.seq = then(self.seq, self.last)
            self.last = None

    def _close_alternatives(self) -> Piece:
        self._push_last()
        out = self.seq
        for alt in self.alts:
            out = either(alt, out)
        return out

    def _open_group(self) -> None:
        if self.p.startswith("?", self.i):
            self._group_flags()
        self._push_last()
        self.stack.append((self.alts, self.seq))
        self.alts, self.seq = [], EMPTY

    def _group_flags(self) -> None:
        """Skip ``?:``, ``?P<name>``, ``?<name>``, ``?flags:``; refuse look-arounds."""
        end = self.i + 1
        if self.p.startswith(("P<", "<"), end) and not self.p.startswith(("<=", "<!"), end):
            close = self.p.find(">", end)
            if close < 0:
                raise Unreadable("unterminated group name")
            self.i = close + 1
            return
        while end < len(self.p) and (self.p[end].isalpha() or self.p[end] == "-"):
            end += 1
        if end >= len(self.p) or self.p[end] not in ":)":
            raise Unreadable("look-around or unknown group")
        self.i = end + 1 if self.p[end] == ":" else end
        if self.p[end] == ")":          # a flag group "(?i)" is an empty group here
            self.i = end

    def _close_group(self) -> None:
        if not self.stack:
            raise Unreadable("unbalanced parenthesis")
        group = self._close_alternatives()
        self.alts, self.seq = self.stack.pop()
        self.last = group

    def _quantify(self, c: str) -> None:
        if self.last is None:
            if c == "{":                # a literal brace
                self._atom(atom(_chars("{")))
                return
            raise Unreadable("quantifier without an atom")
        low, high = {"*": (0, None), "+": (1, None), "?": (0, 1)}.get(c) or self._counts()
        self.last = repeat(self.last, low, high)
        if self.i < len(self.p) and self.p[self.i] in "?+":     # lazy / possessive
            self.i += 1

    def _counts(self) -> tuple[int, Optional[int]]:
        close = self.p.find("}", self.i)
        if close < 0:
            raise Unreadable("unterminated counted repetition")
        low, comma, high = self.p[self.i:close].partition(",")
        self.i = close + 1
        try:
            lo = int(low)
            return lo, (int(high) if high.strip() else None) if comma else lo
        except ValueError:
            raise Unreadable("bad counted repetition") from None

    def _escape(self) -> None:
        if self.i >= len(self.p):
            raise Unreadable("trailing backslash")
        c = self.p[self.i]
        self.i += 1
        if c in _CLASSES:
            self._atom(atom(_CLASSES[c]))
        elif c in _ZERO_WIDTH:
            self._push_last()
        elif c in "pPxu":
            self._atom(atom(self._escape_value(c)))
        else:
            self._atom(atom(_chars(_ESCAPES.get(c, c))))

    def _escape_value(self, c: str) -> int:
        """``\\p{..}`` / ``\\P{..}`` (any letter-like: word characters), ``\\xHH``,
        ``\\x{..}`` / ``\\u{..}`` / ``\\uHHHH`` (one character)."""
        if self.p.startswith("{", self.i):
            close = self.p.find("}", self.i)
            if close < 0:
                raise Unreadable("unterminated escape")
            body, self.i = self.p[self.i + 1:close], close + 1
        else:
            width = {"x": 2, "u": 4}.get(c, 1)
            body, self.i = self.p[self.i:self.i + width], self.i + width
        if c in "pP":
            return _WORD if c == "p" else _ALL & ~_WORD
        try:
            return _chars(chr(int(body, 16)))
        except ValueError:
            raise Unreadable("bad escape") from None

    def _class(self) -> int:
        """A bracketed class from after its ``[``: its members (negated with ``^``); nested
        classes and ``&&`` are read as unions (an over-estimate of the members)."""
        negate = self.p.startswith("^", self.i)
        self.i += negate
        bits, depth, first = 0, 1, True
        while self.i < len(self.p):
            c = self.p[self.i]
            self.i += 1
            if c == "]" and not first:
                depth -= 1
                if depth == 0:
                    return _ALL & ~bits if negate else bits
            elif c == "[":
                depth += 1
            elif c == "\\" and self.i < len(self.p):
                e = self.p[self.i]
                self.i += 1
                bits |= _CLASSES.get(e) or _chars(_ESCAPES.get(e, e))
            elif c == "-" and self.i < len(self.p) and self.p[self.i] != "]" and not first:
                bits |= self._range_to(self.p[self.i - 2], self.p[self.i])
                self.i += 1
            else:
                bits |= _chars(c)
            first = False
        raise Unreadable("unterminated character class")

    @staticmethod
    def _range_to(start: str, end: str) -> int:
        lo, hi = ord(start), ord(end)
        if hi < lo:
            raise Unreadable("reversed class range")
        bits = (1 << (min(hi, 255) + 1)) - (1 << lo) if lo < 256 else 0
        return bits | (_OTHER if hi > 255 else 0)


__all__ = ["expansion", "Piece", "repeat", "then", "either", "atom", "Unreadable"]
