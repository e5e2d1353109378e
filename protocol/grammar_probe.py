"""The submit-time compile of a constraint against a stand-in vocabulary, so that what a
worker's compiler refuses is refused before it reaches a queue.

Why: llguidance's tokenizer-free check (``validate_grammar``) reads a grammar but never runs its
lexer, and the lexer is where hostile constraints fail: ``a{1000}{1000}``, 1,024 choices with
a long common prefix and a ``$ref`` cycle passed at submit and failed only at the worker (issue
#42), after they had taken its compile threads. Producers have no tokenizer, so this one is a
stand-in: every byte, plus a few thousand multi-byte pieces (letter pairs and triples, runs of
``a``, ``0`` and spaces, a few words) so the mask explores multi-byte paths as a real
vocabulary makes it do. The grammar is compiled under the same limits as the engine's
(``structured_outputs.parser_limits``), its first mask computed, and a few bytes walked along
ordinary text: the lexer states those build are the ones that explode.

What it does not catch: a constraint whose lexer grows with the answer, such as
``(\\w+\\s?){1,1000}`` (each of up to 1,000 words a state of its own), fails at a worker after
tens of tokens with a real vocabulary; with this one only after about a kilobyte and seconds of
compile, too dear for every submit. The limit ``max_regex_expansion`` catches that kind from
the pattern alone, before this probe runs (protocol/regex_size.py).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

_LETTERS = "etaoinshrdlu "
_WORDS = ("the", "quick", "brown", "fox", "hello", "world", "this", "is", "answer", "of")
# The bytes walked after the first mask: ordinary text, each byte taken when the grammar allows
# it (else an allowed letter, else the middle allowed byte).
PROBE_TEXT = b"hello world this is a long answer "
PROBE_STEPS = 16


_enabled = True


def skip_in_this_process() -> None:
    """The worker's entry point calls this: a worker compiles every constraint against its
    model's own tokenizer on its compile threads, off the loop that admits jobs, so the
    stand-in adds nothing there but up to half a second of lexer work per new hostile spec on
    that loop. Producers (the SDK, the gateway, the batch runner) keep it."""
    global _enabled
    _enabled = False


def enabled() -> bool:
    return _enabled


class _ProbeVocabulary:
    """The stand-in tokenizer, in the shape ``llguidance.TokenizerWrapper`` reads."""

    def __init__(self) -> None:
        pieces = {"".join(t) for n in (2, 3) for t in itertools.product(_LETTERS, repeat=n)}
        pieces |= {c * k for c in "a0 " for k in range(2, 17)}
        pieces |= {" " + w for w in _WORDS}
        self.tokens = [bytes([i]) for i in range(256)] + [p.encode() for p in sorted(pieces)]
        self.tokens.append(b"<eos>")
        self.eos_token_id = len(self.tokens) - 1
        self.bos_token_id = None
        self.special_token_ids = [self.eos_token_id]

    def __call__(self, text: Any) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


@functools.lru_cache(maxsize=1)
def probe_tokenizer() -> Any:
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ProbeVocabulary()))


def lexer_problem(grammar: str, limits: Any) -> str:
    """Why ``grammar`` fails when compiled and run a little against the probe vocabulary
    under ``limits`` ("" when it does not)."""
    import llguidance

    matcher = llguidance.LLMatcher(probe_tokenizer(), grammar, log_level=0, limits=limits)
    if matcher.is_error() and "token" in (matcher.get_error() or ""):
        return ""       # a special token or token id of the model's own: the worker's to judge
    for step in range(PROBE_STEPS + 1):
        if matcher.is_error():
            return (f"the constraint cannot be compiled for decoding ({matcher.get_error()}); "
                    f"simplify it: no counted repetition inside another (a{{1000}}{{1000}}), "
                    f"no hundreds of long alternatives, no $ref cycle")
        if matcher.is_stopped() or step == PROBE_STEPS:
            return ""
        allowed = _allowed_bytes(matcher.compute_bitmask())
        if matcher.is_error() or not allowed:
            continue
        want = PROBE_TEXT[step % len(PROBE_TEXT)]
        pick = want if want in allowed else next(
            (b for b in allowed if chr(b).isalpha()), allowed[len(allowed) // 2])
        matcher.consume_token(pick)
    return ""


def _allowed_bytes(mask: bytes) -> list[int]:
    """The single-byte tokens (ids 0-255) a bitmask (little-endian bits) allows."""
    return [i for i in range(256) if mask[i >> 3] >> (i & 7) & 1]


__all__ = ["lexer_problem", "probe_tokenizer", "skip_in_this_process", "enabled", "PROBE_STEPS",
           "PROBE_TEXT"]
