"""Structured outputs for ``--model fake:``: a deterministic walk through the constraint's
grammar, so producer and gateway tests on fake workers get answers that satisfy it.

Why a walk and not canned answers: the grammar is the same llguidance grammar the real engine
compiles (``StructuredOutputsParams.lark_grammar``), so whatever a constraint allows -- a JSON
schema, a regex, a choice, a grammar, a tool call -- the fake answer is one of its sentences,
and a test that parses or validates the answer checks the producer's plumbing for real.

The vocabulary is the fake tokenizer's: token id = ``ord(char)`` for ASCII 1-127, 0 is EOS.
At each position the matcher says which characters may come next, and the walker picks:

1. EOS whenever the grammar allows it: an answer ends as soon as it is complete (``stop``);
2. else, one time in four (by the position's hash) or when no letter or digit is allowed, a
   structural character: a closing ``"``, ``}`` or ``]`` first, else another punctuation mark
   the grammar allows -- so strings, arrays and numbers stay short and objects close;
3. else a letter or digit, chosen by the hash among those allowed;
4. else any allowed character (whitespace only when nothing else is allowed).

The hash is the FakeEngine's (prompt, seed, choice, position), so the answer is a pure function
of them and a resumed request replays its delivered tokens into the matcher and continues
exactly. Schema-driven answers are compact (no whitespace), strings a few characters long,
arrays as short as ``minItems`` lets them be. A grammar that needs a non-ASCII character where
nothing else is allowed ends its request with ``invalid_request`` (documented limitation), and
an answer that has not completed by ``max_tokens`` ends ``length``, as a real one would.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

from tokenrelay.engine.errors import InvalidRequestError
from tokenrelay.protocol.structured_outputs import StructuredOutputsParams, parser_limits

EOS = 0
VOCAB = 128
_CLOSERS = '"}]'
_NOT_STRUCTURAL = frozenset("\\ \t\n\r")
FIELD = "params.structured_outputs"


class _CharTokenizer:
    """The fake vocabulary as llguidance's ``TokenizerWrapper`` wants it."""

    eos_token_id = EOS
    bos_token_id = None
    tokens = [b"</s>"] + [bytes([i]) for i in range(1, VOCAB)]
    special_token_ids = [EOS]

    def __call__(self, text: Any) -> list[int]:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return [b for b in data if 0 < b < VOCAB]


@functools.lru_cache(maxsize=1)
def _lltokenizer() -> Any:
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_CharTokenizer()), slices=[])


class FakeConstraint:
    """One choice's matcher over the fake vocabulary, and the walker's pick."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    @classmethod
    def compile(cls, spec: StructuredOutputsParams, replay: Sequence[int] = ()) -> "FakeConstraint":
        """The constraint's matcher, with ``replay`` (a resumed choice's tokens) consumed.
        InvalidRequestError (naming the field) when it does not compile or refuses them."""
        import llguidance

        matcher = llguidance.LLMatcher(_lltokenizer(), spec.lark_grammar(), log_level=0,
                                       limits=parser_limits())
        if matcher.is_error():
            raise InvalidRequestError(f"{FIELD}: {matcher.get_error()}")
        if replay and not matcher.consume_tokens([int(t) for t in replay]):
            raise InvalidRequestError(f"{FIELD}: the {len(replay)} tokens already delivered "
                                      f"do not follow the constraint ({matcher.get_error()})")
        return cls(matcher)

    def fork(self) -> "FakeConstraint":
        return FakeConstraint(self.matcher.deep_copy())

    def next_token(self, h: int) -> int:
        """The walker's pick for hash ``h`` (see the module docstring), consumed; EOS when the
        answer is complete. InvalidRequestError when the grammar allows no ASCII character."""
        mask = self.matcher.compute_bitmask()
        allowed = [i for i in range(VOCAB) if mask[i >> 3] >> (i & 7) & 1]
        if not allowed or self.matcher.is_error():
            raise InvalidRequestError(f"{FIELD}: the fake engine's ASCII vocabulary cannot "
                                      f"continue this answer ({self.matcher.get_error() or 'no character allowed'})")
        if EOS in allowed:
            return EOS
        chars = [chr(i) for i in allowed]
        structural = [c for c in chars if c.isprintable() and not c.isalnum()
                      and c not in _NOT_STRUCTURAL]
        content = [c for c in chars if c.isalnum()]
        if structural and (not content or h % 4 == 0):
            closers = [c for c in _CLOSERS if c in structural]
            pick = closers[0] if closers else structural[(h >> 2) % len(structural)]
        elif content:
            pick = content[(h >> 2) % len(content)]
        else:
            pick = chars[(h >> 2) % len(chars)]
        self.matcher.consume_token(ord(pick))
        return ord(pick)


__all__ = ["FakeConstraint", "EOS"]
