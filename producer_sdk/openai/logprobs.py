"""OpenAI's logprobs objects, from the worker's TokenLogprob records (or, from older workers,
token ids): chat's ``ChoiceLogprobs`` and a completion's ``Logprobs``. Part of the OpenAI shapes
(``producer_sdk/openai/format.py`` re-exports these names); nothing here does I/O."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from tokenrelay.protocol.logprobs import TokenLogprob, TopLogprob

# The token text of a logprob entry when the worker sent only token ids: vLLM's spelling for
# ``--return-tokens-as-token-ids``, so a client can still tell tokens apart.
TOKEN_ID_PREFIX = "token_id:"


def token_logprobs_from_ids(token_ids: Sequence[int],
                            tops: Sequence[dict[int, float]]) -> list[TokenLogprob]:
    """TokenLogprob records for a worker that sent only ids (``{id: logprob}`` per position,
    the chosen token among them): each token named ``token_id:<id>`` with no bytes, because
    without the tokenizer its text is unknown."""
    out = []
    for tid, top in zip(token_ids, tops):
        alts = [TopLogprob(token_id=k, token=f"{TOKEN_ID_PREFIX}{k}", logprob=v)
                for k, v in sorted(top.items(), key=lambda kv: -kv[1])]
        out.append(TokenLogprob(token_id=tid, token=f"{TOKEN_ID_PREFIX}{tid}",
                                logprob=top.get(tid, float("-inf")), top_logprobs=alts))
    return out


def token_logprobs_of(item: Any) -> list[TokenLogprob]:
    """The TokenLogprob records of a Delta or CompletionOutput: its ``token_logprobs`` when the
    worker sent token text, else built from its ids and ``logprobs`` maps; [] when none."""
    records = getattr(item, "token_logprobs", None)
    if records:
        return list(records)
    tops = getattr(item, "logprobs", None)
    return token_logprobs_from_ids(item.token_ids, tops) if tops else []


def _finite(value: float) -> float:
    """JSON has no -inf; OpenAI reports an impossible token as -9999.0."""
    return value if value > -9999.0 else -9999.0


def _top_limit(records: Iterable[TokenLogprob], top: int) -> Iterable[tuple[TokenLogprob, list]]:
    """Each record with its alternatives cut to the ``top`` asked for (the engine returns the
    chosen token beside them, which OpenAI does not count)."""
    for r in records:
        yield r, list(r.top_logprobs)[:top]


def chat_logprobs(records: Sequence[TokenLogprob], top: int) -> dict[str, Any]:
    """``ChoiceLogprobs`` of a chat choice (or chunk): one entry per token, ``top`` alternatives."""
    return {"content": [{"token": r.token, "bytes": list(r.bytes) or None,
                         "logprob": _finite(r.logprob),
                         "top_logprobs": [{"token": t.token, "bytes": list(t.bytes) or None,
                                           "logprob": _finite(t.logprob)} for t in alts]}
                        for r, alts in _top_limit(records, top)],
            "refusal": None}


def completion_logprobs(records: Sequence[TokenLogprob], top: int,
                        text_offset: int = 0) -> dict[str, Any]:
    """``Logprobs`` of a completion choice (or chunk); ``text_offset`` of the first token."""
    offsets, at = [], text_offset
    for r in records:
        offsets.append(at)
        at += len(r.token)
    pairs = list(_top_limit(records, top))
    return {"tokens": [r.token for r, _ in pairs],
            "token_logprobs": [_finite(r.logprob) for r, _ in pairs],
            "top_logprobs": [{t.token: _finite(t.logprob) for t in alts} for _, alts in pairs],
            "text_offset": offsets}


def logprobs_body(chat: bool, records: Sequence[TokenLogprob], top: int,
                  text_offset: int = 0) -> dict[str, Any]:
    return chat_logprobs(records, top) if chat else completion_logprobs(records, top, text_offset)
