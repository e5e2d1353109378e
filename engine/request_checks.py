"""The checks ``LLMEngine.add_request`` runs before it changes anything: the prompt's ids, the
``logit_bias`` ids, the number of choices, the resume states and whether the request could ever
fit the KV pool. Each raises InvalidRequestError / PromptTooLongError naming the field and
giving the numbers."""

from __future__ import annotations

import numbers
from typing import Any, Optional, Union

from tokenrelay.engine.errors import InvalidRequestError, PromptTooLongError
from tokenrelay.engine.outputs import ResumeState
from tokenrelay.engine.sampling_params import SamplingParams


def prompt_ids(prompt: Union[str, list[int]], tokenizer: Any, vocab_size: int) -> list[int]:
    """The prompt's token ids, each checked against the vocabulary."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt: must not be empty")
        ids = list(tokenizer.encode(prompt))
        if not ids:
            raise InvalidRequestError("prompt: tokenizes to zero tokens")
        return ids
    if not isinstance(prompt, (list, tuple)):
        raise InvalidRequestError(
            f"prompt: must be a string or a list of token ids, got {type(prompt).__name__}")
    if not prompt:
        raise InvalidRequestError("prompt: must not be empty")
    check_token_ids("prompt", prompt, vocab_size)
    return [int(t) for t in prompt]


def check_token_ids(field: str, ids: Any, vocab_size: int) -> None:
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise InvalidRequestError(f"{field}: token ids must be integers, got {t!r}")
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(
                f"{field}: token id {t} is outside the vocabulary [0, {vocab_size})")


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """The schema bounds ``logit_bias``'s keys and values; only the engine knows its vocabulary,
    so an id past it is refused here (naming the field) rather than indexing past the logits."""
    if params.logit_bias:
        check_token_ids("logit_bias", sorted(params.logit_bias), vocab_size)


def check_width(params: SamplingParams, config: Any) -> None:
    """Choices past the configured bounds, or more than could ever run at once, are the
    request's error (naming the field) rather than a request that stalls the scheduler."""
    field, limit = (("beam_width", config.max_beam_width) if params.use_beam_search
                    else ("n", config.max_n))
    width = params.num_choices
    if width > limit:
        raise InvalidRequestError(f"{field}: {width} exceeds this engine's limit of {limit} "
                                  f"(EngineConfig.max_{field})")
    for knob in ("max_num_seqs", "max_num_batched_tokens"):
        cap = int(getattr(config, knob))
        if width > 1 and width > cap:
            raise InvalidRequestError(f"{field}: {width} choices cannot run together with "
                                      f"{knob}={cap}")


def resume_states(resume: Any, params: SamplingParams, vocab_size: int
                  ) -> Optional[list[ResumeState]]:
    """One ResumeState per choice, or None when nothing was delivered (a fresh start)."""
    if resume is None:
        return None
    if params.use_beam_search:
        raise InvalidRequestError("resume: beam search is not resumed; run it again")
    states = [resume] if isinstance(resume, ResumeState) else list(resume)
    if len(states) != params.n or not all(isinstance(s, ResumeState) for s in states):
        raise InvalidRequestError(f"resume: expected {params.n} ResumeState (one per choice)")
    for st in states:
        check_token_ids("resume.output_token_ids", st.output_token_ids, vocab_size)
        if st.finish_reason is None and len(st.output_token_ids) >= params.max_tokens:
            raise InvalidRequestError(
                f"resume: {len(st.output_token_ids)} tokens already emitted, max_tokens is "
                f"{params.max_tokens}; nothing left to generate")
    if all(st.finish_reason is not None for st in states):
        raise InvalidRequestError("resume: every choice has already finished")
    if all(not st.output_token_ids and st.finish_reason is None for st in states):
        return None
    return states


def check_pool(p: int, params: SamplingParams, bm: Any) -> None:
    """The request with all its choices must fit the whole pool: the prompt's full blocks
    once, and each choice's own blocks (its copy of the partial block included)."""
    m, width = params.max_tokens, params.num_choices
    shortfall = bm.pool_shortfall(p + m - 1)   # the last sampled token needs no KV
    if shortfall is not None:
        raise PromptTooLongError(f"prompt ({p} tokens) + max_tokens ({m}) {shortfall}")
    shared = p // bm.block_size
    need = shared + width * (bm.blocks_for(p + m - 1) - shared)
    if width > 1 and need > bm.num_blocks:
        field = "beam_width" if params.use_beam_search else "n"
        raise PromptTooLongError(
            f"{field}: {width} choices of prompt ({p} tokens) + max_tokens ({m}) need "
            f"{need} KV blocks of {bm.block_size} tokens, the pool has {bm.num_blocks}")
