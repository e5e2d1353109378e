"""Incremental detokenization with stop strings.

Decoding one token at a time is wrong in two ways: byte-level BPE splits multi-byte UTF-8
characters over several tokens, and SentencePiece-style tokenizers drop a word's leading space
when the word is decoded on its own. So each step decodes a small sliding window twice, the
already-read tokens alone and the window with the new tokens, and emits the difference; while
that ends in U+FFFD (an incomplete character) the tokens stay unread. The window starts with a
few prompt tokens so the first output word keeps its leading space.

Stop strings can span tokens, so any tail of the text that could still become a stop string is
held back; on a match the text is cut there (the stop string itself kept only with
``include_stop_str_in_output``). Everything before the held-back tail has been handed out and
cannot hold the start of a stop string, so a step searches only the held-back ``tail``:
the held-back tail (under the longest stop's length) plus the new text. The stop strings are
indexed once per request (``StopMatcher``), so a step's cost depends on that window and on the
stops that can start in it, not on how many stops the request lists or how long it has run.

The engine detokenizes all sequences of a step with one batched decode call
(``detokenize_step``); ``IncrementalDetokenizer.add`` does the same for one sequence.
"""

from __future__ import annotations

import weakref
from bisect import bisect_left
from typing import Any, Optional, Sequence

from tokenrelay.engine.sampling_params import SamplingParams

_PROMPT_WINDOW = 5  # prompt tokens that seed the decode window


# One token decoded alone, per Rust tokenizer and skip_special_tokens: the already-read window
# of a steady decode is the previous step's one token, so half of a step's decodes are these.
_SINGLE: "weakref.WeakKeyDictionary[Any, dict[tuple[bool, int], str]]" = weakref.WeakKeyDictionary()


def _decode_batch(tokenizer: Any, batches: list[list[int]], skip_special_tokens: bool) -> list[str]:
    """Decode many short windows. One ``decode`` call per window on the Rust tokenizer, not
    its ``decode_batch``: that one hands the windows to a rayon thread pool, which has to fight
    torch's compute threads for the cores; in the engine it took 1.6 ms per step for 48
    sequences, the plain loop under 0.2 ms. One-token windows come from a per-tokenizer
    memo (a decode is a pure function of the ids)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode"):
        return tokenizer.batch_decode(batches, skip_special_tokens=skip_special_tokens,
                                      clean_up_tokenization_spaces=False)
    memo = _SINGLE.setdefault(backend, {})
    out = []
    for b in batches:
        if len(b) == 1:
            key = (skip_special_tokens, b[0])
            text = memo.get(key)
            if text is None:
                text = memo[key] = backend.decode(b, skip_special_tokens=skip_special_tokens)
            out.append(text)
        else:
            out.append(backend.decode(b, skip_special_tokens=skip_special_tokens))
    return out


class StopMatcher:
    """One request's stop strings, indexed once when the request is added.

    A step's new text can only complete a stop that ends in it, so ``find`` looks only at the
    stops whose last character is among the new characters, each with one ``str.find`` over the
    new text plus that stop's length; ``held`` tests tails that start with some stop's first
    character, by binary search in the sorted stops. A regex alternation of the stops would be
    one call, but it retries every alternative at every position of the window: on a held-back
    tail that keeps almost matching (``"a" * 511`` against stops ``"a" * 510 + "xa"``) that is
    quadratic in the stop length, every step.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if not stops or any(not s for s in stops):
            raise ValueError("a StopMatcher needs one or more non-empty stop strings")
        self.max_len = max(len(s) for s in stops)
        first_rank: dict[str, int] = {}          # a repeated stop keeps its first place
        for rank, s in enumerate(stops):
            first_rank.setdefault(s, rank)
        by_last: dict[str, list[tuple[int, str]]] = {}
        for s, rank in first_rank.items():
            by_last.setdefault(s[-1], []).append((rank, s))
        self._by_last = by_last
        self._firsts = frozenset(s[0] for s in stops)
        self._sorted = sorted(first_rank)

    def find(self, window: str, searched: int = 0) -> Optional[tuple[int, str]]:
        """The earliest stop occurrence in ``window`` as (index, stop); at one index the stop
        listed first wins. ``window[:searched]`` is known to hold no whole stop (an earlier
        step searched it), so only stops ending after it are looked for."""
        best: Optional[tuple[int, int, str]] = None
        for last in self._by_last.keys() & set(window[searched:]):
            for rank, s in self._by_last[last]:
                i = window.find(s, max(0, searched - len(s) + 1))
                if i >= 0 and (best is None or (i, rank) < best[:2]):
                    best = (i, rank, s)
        return None if best is None else (best[0], best[2])

    def held(self, window: str) -> int:
        """Length of the longest tail of ``window`` (shorter than the longest stop) that is a
        prefix of a stop string, so it might still become one.

        Tails are tried longest first from the last step's held tail plus the new text, so a
        step tries at most the longest stop's length of them, and over a whole sequence at
        most its length in characters plus that (each failed start is one the text moved
        past)."""
        for n in range(min(self.max_len - 1, len(window)), 0, -1):
            if window[-n] in self._firsts and self._is_prefix(window[-n:]):
                return n
        return 0

    def _is_prefix(self, tail: str) -> bool:
        """Strings starting with ``tail`` sort right at ``tail``'s insertion point."""
        i = bisect_left(self._sorted, tail)
        return i < len(self._sorted) and self._sorted[i].startswith(tail)


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stops: Optional[StopMatcher] = StopMatcher(params.stop) if params.stop else None
        self.include_stop = params.include_stop_str_in_output
        window = list(prompt_token_ids[-_PROMPT_WINDOW:])
        self.tokens: list[int] = window       # decode window: prompt tail, then outputs
        self.prefix_offset = 0
        self.read_offset = len(window)
        # The decoded text is ``"".join(self.handed) + self.tail``: what was handed out, in
        # pieces, and what is held back (partial stop matches), so a step touches only the
        # tail and its new text, never the whole text so far.
        self.handed: list[str] = []
        self.tail = ""
        self.stopped: Optional[str] = None
        self.searched = 0                       # chars of ``tail`` known to hold no whole stop

    # -- two-phase API, so the engine can decode every sequence in one call ----------------
    def push(self, token_ids: list[int]) -> tuple[list[int], list[int]]:
        """Append tokens; return the (already-read, whole) windows to decode."""
        self.tokens.extend(token_ids)
        return (self.tokens[self.prefix_offset:self.read_offset], self.tokens[self.prefix_offset:])

    def commit(self, prefix_text: str, full_text: str, *, final: bool = False) -> tuple[str, Optional[str]]:
        """Take the decoded windows; return (text delta, matched stop string or None).

        ``final`` flushes everything held back (the sequence ended for another reason).
        """
        if len(full_text) > len(prefix_text) and (final or not full_text.endswith("\ufffd")):
            self.tail += full_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
        return self._emit(final)

    def add(self, token_ids: list[int], *, final: bool = False) -> tuple[str, Optional[str]]:
        prefix_ids, full_ids = self.push(token_ids)
        prefix_text, full_text = _decode_batch(self.tokenizer, [prefix_ids, full_ids],
                                               self.skip_special_tokens)
        return self.commit(prefix_text, full_text, final=final)

    def flush(self) -> str:
        """Everything still held back (partial characters, partial stop matches)."""
        delta, _ = self.add([], final=True)
        return delta

    # -- stop strings ----------------------------------------------------------------------
    def _emit(self, final: bool) -> tuple[str, Optional[str]]:
        if self.stopped is not None:
            return "", None
        window = self.tail
        upto = len(window)
        if self.stops is not None:
            hit = self.stops.find(window, self.searched)
            self.searched = len(window)
            if hit is not None:
                i, s = hit
                end = i + (len(s) if self.include_stop else 0)
                self.stopped = s
                return self._hand_out(end), s
            if not final:
                upto -= self.stops.held(window)
        return self._hand_out(upto), None

    def _hand_out(self, n: int) -> str:
        """The tail's first ``n`` characters become handed-out text."""
        delta, self.tail = self.tail[:n], self.tail[n:]
        self.searched = max(0, self.searched - n)
        if delta:
            self.handed.append(delta)
        return delta

    @property
    def output_text(self) -> str:
        """The text handed out so far."""
        return "".join(self.handed)

    def replay(self, token_ids: list[int], emitted_text: str) -> None:
        """Rebuild the state another worker had after emitting ``token_ids``/``emitted_text``.

        The same step-by-step algorithm runs over the tokens, so later deltas are exactly what
        that worker would have produced; ``emitted_text`` says how much of it the client has.
        """
        for t in token_ids:
            self.add([t])
        self.stopped = None
        text = self.output_text + self.tail
        if not text.startswith(emitted_text):
            # The tokens decode differently than the text the client got (e.g. another
            # tokenizer version). Trust the client's text: continue right after it.
            text = emitted_text
        self.handed = [emitted_text] if emitted_text else []
        self.tail = text[len(emitted_text):]
        self.searched = 0


def detokenize_step(items: list[tuple[IncrementalDetokenizer, list[int], bool]]
                    ) -> list[tuple[str, Optional[str]]]:
    """Detokenize one step for many sequences: (detokenizer, new token ids, final) each.

    All windows go to the tokenizer in one batched call per ``skip_special_tokens`` value.
    """
    results: list[Optional[tuple[str, Optional[str]]]] = [None] * len(items)
    for skip in (True, False):
        idx = [i for i, (d, _, _) in enumerate(items) if d.skip_special_tokens is skip]
        if not idx:
            continue
        windows: list[list[int]] = []
        for i in idx:
            d, toks, _ = items[i]
            windows.extend(d.push(toks))
        texts = _decode_batch(items[idx[0]][0].tokenizer, windows, skip)
        for j, i in enumerate(idx):
            d, _, final = items[i]
            results[i] = d.commit(texts[2 * j], texts[2 * j + 1], final=final)
    return results  # type: ignore[return-value]
