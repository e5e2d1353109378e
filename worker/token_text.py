"""The text and bytes of single tokens, for logprobs (``logprob_tokens`` on the wire).

OpenAI names each token of its logprobs by ``token`` (text) and ``bytes``; producers have no
tokenizer, so the worker sends both for every id a job's logprobs name, and only for jobs that
asked for logprobs (the hot path of every other job is untouched).

What we send for token id ``t``:

* text: ``tokenizer.decode([t], skip_special_tokens=False)`` -- the tokenizer's decode of the
  single id (a special token shows its name, e.g. ``</s>``, rather than nothing);
* bytes: the token's raw bytes. For byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) a token may
  hold part of a UTF-8 character, whose text decodes to U+FFFD; OpenAI gives the raw bytes then,
  so we map the vocabulary piece (``convert_ids_to_tokens``) through GPT-2's byte alphabet. A
  SentencePiece byte-fallback piece ``<0xE2>`` is that byte. The raw bytes are used only when
  they decode (with replacement, as the tokenizer's decoder does) to exactly the text above, so
  a tokenizer of another kind (SentencePiece's ``▁`` pieces, the fake engine's) falls back to
  the text's UTF-8 bytes, never to wrong bytes.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any, Iterable, Mapping, Optional

_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_CACHE_IDS = 1 << 18   # more than any vocabulary: each id is decoded once per worker


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character a vocabulary piece uses for each byte
    (printable bytes stand for themselves, the others are shifted past U+0100)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    shifted = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + shifted)
            shifted += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def piece_bytes(piece: Any, text: str) -> Optional[bytes]:
    """The raw bytes of a vocabulary piece when they are what ``text`` was decoded from."""
    if not isinstance(piece, str) or not piece:
        return None
    m = _BYTE_PIECE.match(piece)
    if m:
        raw = bytes([int(m.group(1), 16)])
    else:
        table = byte_decoder()
        if any(c not in table for c in piece):
            return None
        raw = bytes(table[c] for c in piece)
    return raw if raw.decode("utf-8", "replace") == text else None


class TokenTexts:
    """``(text, bytes)`` of token ids, decoded once each (the vocabulary is bounded)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._pieces = getattr(tokenizer, "convert_ids_to_tokens", None)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._decode(token_id)
            if len(self._cache) >= _CACHE_IDS:
                self._cache.clear()
            self._cache[token_id] = hit
        return hit

    def _decode(self, token_id: int) -> tuple[str, bytes]:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        raw = None
        if self._pieces is not None:
            raw = piece_bytes(self._pieces(token_id), text)
        return text, raw if raw is not None else text.encode("utf-8")

    def for_logprobs(self, logprobs: Iterable[Mapping[int, float]]) -> dict[int, tuple[str, bytes]]:
        """Every id the per-token ``{token_id: logprob}`` maps name (the wire's
        ``logprob_tokens``)."""
        return {int(t): self.get(int(t)) for d in logprobs for t in d}


__all__ = ["TokenTexts", "byte_decoder", "piece_bytes"]
