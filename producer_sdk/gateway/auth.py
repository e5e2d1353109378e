"""Bearer-token auth: which keys may call the gateway, and the priority lane of each.

Keys come from ``--api-keys`` (``TOKENRELAY_API_KEYS``, a JSON list) and ``--api-keys-file``,
each entry ``KEY`` or ``KEY PRIORITY``: a tenant's batch key can be given ``1`` (the bulk lane)
and an interactive one ``-1`` (urgent), so one gateway serves both without a second queue.
With no key configured at all, auth is off. Keys are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence


class KeyFileError(ValueError):
    """A key entry that cannot be read; names the file and line."""


@dataclass(frozen=True, slots=True)
class ApiKey:
    key: str
    priority: Optional[int]     # None: the gateway's --default-priority

    @property
    def producer(self) -> str:
        """The key's producer id on its jobs (``JobRequest.producer``: the unit workers share
        grammar compiles fairly among): a fingerprint of the key, since job payloads are
        readable by every worker and operator and must never carry the secret itself."""
        return "key-" + hashlib.sha256(self.key.encode()).hexdigest()[:16]


def parse_key(entry: str, where: str) -> ApiKey:
    """``"KEY"`` or ``"KEY PRIORITY"`` (whitespace-separated; keys hold no whitespace)."""
    parts = entry.split()
    if len(parts) not in (1, 2):
        raise KeyFileError(f"{where}: want 'KEY' or 'KEY PRIORITY', got {len(parts)} fields")
    priority = None
    if len(parts) == 2:
        try:
            priority = int(parts[1])
        except ValueError:
            raise KeyFileError(f"{where}: priority {parts[1]!r} is not an integer") from None
    return ApiKey(parts[0], priority)


def load_keys(entries: Sequence[str], path: Optional[str]) -> list[ApiKey]:
    """Keys given inline and in the file (blank lines and ``#`` comments skipped)."""
    keys = [parse_key(e, f"--api-keys entry {i + 1}") for i, e in enumerate(entries)]
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise KeyFileError(f"--api-keys-file {path}: {exc.strerror or exc}") from None
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if line:
                keys.append(parse_key(line, f"{path} line {n}"))
    return keys


class KeyRing:
    """Looks a bearer token up; ``enabled`` is False when no key is configured."""

    def __init__(self, keys: Sequence[ApiKey]) -> None:
        self.keys = list(keys)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def find(self, token: Optional[str]) -> Optional[ApiKey]:
        """The key matching ``token``, or None. Every key is compared (no early exit)."""
        if token is None:
            return None
        found = None
        for k in self.keys:
            if hmac.compare_digest(k.key.encode(), token.encode()):
                found = k
        return found


def bearer_token(header: Optional[str]) -> Optional[str]:
    """The token of an ``Authorization: Bearer <token>`` header, else None."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None
