"""Answers the gateway's ``/tokenize`` and ``/detokenize`` for this worker's queue
(``protocol/tokenize.py`` says why a worker answers them and how the exchange goes).

A thread of its own, beside the loop: a call never waits for an engine step, and the loop
never waits for a call. It uses only the engine's tokenizer and chat template (no KV, no
scheduler), exactly as admission tokenizes a job (``worker/admission.py``), so a count it gives
is that job's ``usage.prompt_tokens``. Whatever a call holds, it ends that call alone: an answer
with an ``error``; a Redis error pauses the thread for a moment and it reads on.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from pydantic import ValidationError

from tokenrelay.engine.errors import InvalidRequestError
from tokenrelay.engine.request_checks import check_token_ids
from tokenrelay.protocol.keys import GROUP, Keys
from tokenrelay.protocol.tokenize import (CALLS_MAXLEN, REPLY_TTL_MS, TokenizeAnswer,
                                          TokenizeCall, TokenizeError, pack, unpack)
from tokenrelay.worker.connection import REDIS_ERRORS

BATCH = 16          # calls read at once


def answer_call(engine: Any, call: TokenizeCall) -> TokenizeAnswer:
    """The answer to one call from ``engine``'s tokenizer and template (an ``error`` answer
    for what the engine refuses; never raises for a call's content)."""
    try:
        if call.kind == "detokenize":
            return _detokenize(engine, call.tokens or [])
        return _tokenize(engine, call)
    except (InvalidRequestError, ValueError, TypeError) as exc:
        field = str(exc).split(":", 1)[0] if ":" in str(exc) else None
        return TokenizeAnswer(error=TokenizeError(code="invalid_request", message=str(exc),
                                                  param=field if field and " " not in field
                                                  else None))


def _tokenize(engine: Any, call: TokenizeCall) -> TokenizeAnswer:
    if call.messages is not None:
        text = engine.render_chat([m.model_dump() for m in call.messages],
                                  call.chat_template_kwargs)
        special = bool(call.add_special_tokens)          # the template holds them
    else:
        text = call.prompt or ""
        special = True if call.add_special_tokens is None else call.add_special_tokens
    ids = [int(t) for t in engine.tokenizer.encode(text, add_special_tokens=special)]
    return TokenizeAnswer(tokens=ids, count=len(ids), max_model_len=engine.max_model_len)


def _detokenize(engine: Any, tokens: list[int]) -> TokenizeAnswer:
    vocab = getattr(engine, "vocab_size", None)
    if vocab is not None:
        check_token_ids("tokens", tokens, int(vocab))
    return TokenizeAnswer(prompt=engine.tokenizer.decode(tokens))


class TokenizeServer:
    """Reads ``Keys.tokenize_calls`` in the queue's group as ``consumer`` and answers each
    call on its reply stream; ``start`` / ``close`` bound its thread's life. ``client`` gives
    the worker's current Redis client (a reconnect replaces it)."""

    def __init__(self, client: Callable[[], Any], keys: Keys, engine: Any, consumer: str,
                 log: Any, block_ms: int = 500) -> None:
        self._client = client
        self.keys = keys
        self.engine = engine
        self.consumer = consumer
        self.log = log
        self.block_ms = block_ms
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._grouped = False
        self._last_error = ""

    @property
    def client(self) -> Any:
        return self._client()

    def start(self) -> "TokenizeServer":
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"tokenize-{self.consumer}")
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.client is None:           # between connections
                self._stop.wait(min(1.0, self.block_ms / 1000))
                continue
            try:
                self.serve_once()
            except REDIS_ERRORS as exc:       # the loop reports connection trouble itself
                self._grouped = "NOGROUP" not in str(exc) and self._grouped
                self._note(exc)
                self._stop.wait(min(1.0, self.block_ms / 1000))
            except Exception:                 # a bug here must not end the worker
                self.log.exception("tokenize call failed")
                self._stop.wait(1.0)

    def _note(self, exc: BaseException) -> None:
        """Log a Redis error once until it changes (an ACL without the commands this needs,
        NOPERM, would otherwise fail every call in silence)."""
        text = f"{type(exc).__name__}: {exc}"[:300]
        if text != self._last_error:
            self._last_error = text
            self.log.warning("tokenize calls cannot be read; /tokenize for this queue will "
                             "time out until this is fixed", error=text)

    def serve_once(self) -> int:
        """Read up to ``BATCH`` calls (blocking up to ``block_ms``) and answer them; how many."""
        key = self.keys.tokenize_calls
        self._ensure_group(key)
        got = self.client.xreadgroup(GROUP, self.consumer, {key: ">"}, count=BATCH,
                                     block=self.block_ms)
        entries = [e for _, stream_entries in (got or []) for e in stream_entries]
        for entry_id, fields in entries:
            self._answer(fields)
            client = self.client
            client.xack(key, GROUP, entry_id)
            client.xdel(key, entry_id)
        return len(entries)

    def _ensure_group(self, key: str) -> None:
        if self._grouped:
            return
        try:
            self.client.xgroup_create(key, GROUP, id="0", mkstream=True)
        except REDIS_ERRORS as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._grouped = True

    def _answer(self, fields: dict) -> None:
        try:
            call = unpack(fields, TokenizeCall)
        except (ValidationError, ValueError) as exc:    # no id to answer to: dropped, logged
            self.log.warning("tokenize call refused", error=str(exc)[:300])
            return
        reply = self.keys.tokenize_reply(call.id)
        pipe = self.client.pipeline(transaction=False)
        pipe.xadd(reply, pack(answer_call(self.engine, call)), maxlen=1)
        pipe.pexpire(reply, REPLY_TTL_MS)
        pipe.execute()


__all__ = ["TokenizeServer", "answer_call", "CALLS_MAXLEN"]
