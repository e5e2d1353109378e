"""A job's token cost: what the queue's token budget (``max_queued_tokens``) admits and releases.

Why a cost and not a count: 100,000 jobs of 30,000 tokens are not 100,000 jobs of 10, and a
queue bounded by job count alone admits both alike. The cost is what a job may make a worker
hold in its KV cache and compute: its prompt tokens plus the tokens it may generate.

One function computes it (``job_cost``), here in the protocol, because the producer that admits
a job and the worker that releases it must agree on the number: the producer computes it once,
the enqueue script adds it to the shard's counter (``Keys.budget``) and stores it in the job's
stream entry (field ``protocol.keys.COST_FIELD``, beside the payload), and the script that
writes the job's terminal event subtracts exactly that stored number. Nothing recomputes it.

Producers have no tokenizer, so a text prompt is estimated from its UTF-8 size:
``ceil(bytes / BYTES_PER_TOKEN)`` with 3 bytes per token, above what BPE vocabularies of
current models take for English prose (about 4 bytes a token) and about what they take for
CJK text (one 3-byte character a token): conservative, it over-counts ordinary text by up to a
third rather than under-count it. Chat messages (and tools) are measured as their msgpack
encoding, which adds role names and keys as a stand-in for the chat template's own tokens.
``prompt_token_ids`` are counted exactly.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import msgpack

from tokenrelay.protocol.sampling_params import DEFAULT_MAX_TOKENS, default_max_tokens

BYTES_PER_TOKEN = 3
# The context a chat job without max_tokens is assumed to fill when the producer knows no
# better (worker/admission.py gives such a job max_model_len - prompt tokens).
DEFAULT_CONTEXT_TOKENS = 8192


def text_tokens(text: str) -> int:
    """Estimated tokens of a text: its UTF-8 bytes / BYTES_PER_TOKEN, rounded up (ASCII text
    is measured without encoding it: the bulk path calls this per job)."""
    size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return -(-size // BYTES_PER_TOKEN)


def prompt_tokens(prompt: Optional[str] = None, messages: Optional[Sequence[Any]] = None,
                  prompt_token_ids: Optional[Sequence[int]] = None,
                  tools: Optional[Sequence[Any]] = None) -> int:
    """Prompt tokens of a job's input: exact for ``prompt_token_ids``, else estimated."""
    if prompt_token_ids is not None:
        return len(prompt_token_ids)
    if messages is not None:
        size = len(msgpack.packb([messages, tools or []], use_bin_type=True, default=str))
        return -(-size // BYTES_PER_TOKEN)
    return text_tokens(prompt or "")


def completion_tokens(params: Mapping[str, Any], prompt: int, chat: bool,
                      context_tokens: int = DEFAULT_CONTEXT_TOKENS) -> int:
    """Tokens a job may generate: ``max_tokens`` per choice (``n`` samples, or ``beam_width``
    beams: each is a sequence of its own), or without ``max_tokens`` what the worker will give
    it (``default_max_tokens``, with no model default: the producer knows none)."""
    width = max(int(params.get("n") or 1), int(params.get("beam_width") or 1))
    max_tokens = params.get("max_tokens")
    if max_tokens is None:
        max_tokens = max(0, default_max_tokens(chat, context_tokens - prompt))
    return int(max_tokens) * width


def job_cost(job: Mapping[str, Any], context_tokens: int = DEFAULT_CONTEXT_TOKENS) -> int:
    """The cost of one job payload (a JobRequest map): prompt plus completion tokens, at least
    1 so every admitted job counts."""
    prompt = prompt_tokens(job.get("prompt"), job.get("messages"), job.get("prompt_token_ids"),
                           job.get("tools"))
    chat = job.get("messages") is not None
    return max(1, prompt + completion_tokens(job.get("params") or {}, prompt, chat,
                                             context_tokens))


def entry_cost(raw: Any) -> int:
    """The cost stored in a job entry (``COST_FIELD``'s value); 0 when absent or unreadable (a
    producer that does not use the budget admitted nothing, so nothing is released)."""
    try:
        value = int(raw)
    except (TypeError, ValueError):
        return 0
    return max(0, value)


__all__ = ["BYTES_PER_TOKEN", "DEFAULT_CONTEXT_TOKENS", "DEFAULT_MAX_TOKENS",
           "completion_tokens", "entry_cost", "job_cost", "prompt_tokens", "text_tokens"]
