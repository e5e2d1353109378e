"""The checks a request passes before it reaches the engine core, run by the front end
(``LLMEngine.add_request``, ``EngineCoreClient.add_request``) before anything changes: its
id, its sampling fields, the prompt's ids, the ``logit_bias`` ids, the number of choices, the
resume states and whether it could ever fit the KV pool. Each raises InvalidRequestError /
PromptTooLongError naming the field and giving the numbers (or pydantic's ValidationError for
a bad field)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from tokenrelay.engine.block_manager import PoolShape
from tokenrelay.engine.errors import InvalidRequestError, PromptTooLongError
from tokenrelay.engine.outputs import CoreRequest, ResumeState
from tokenrelay.engine.prompts import prompt_of
from tokenrelay.engine.sampling_params import SamplingParams
from tokenrelay.protocol.sampling_params import min_tokens_fit


@dataclass(frozen=True)
class RequestChecks:
    """Everything the checks read: the resolved config, the tokenizer, the vocabulary size
    and the pool's shape (all fixed once the engine is built)."""

    config: Any
    tokenizer: Any
    vocab_size: int
    pool: PoolShape

    def build(self, request_id: str, prompt: Any,
              params: Union[SamplingParams, Mapping[str, Any], None], priority: int,
              resume: Any) -> tuple[CoreRequest, Optional[str]]:
        """The core's request, and the prompt's text (None when it came as token ids)."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id: must be a non-empty string")
        params = sampling_params(params)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority: must be an integer, got {priority!r}")
        if not min_tokens_fit(params.min_tokens, params.max_tokens):  # the schema checks only when set
            raise InvalidRequestError(f"min_tokens: {params.min_tokens} exceeds max_tokens "
                                      f"({params.max_tokens})")
        check_logit_bias(params, self.vocab_size)
        check_width(params, self.config)
        prompt = prompt_of(prompt)
        ids = prompt_ids(prompt, self.tokenizer, self.vocab_size)
        states = resume_states(resume, params, self.vocab_size)
        p, m = len(ids), params.max_tokens
        limit = self.config.max_model_len
        if p + m > limit:
            raise PromptTooLongError(f"prompt ({p} tokens) + max_tokens ({m}) = {p + m} "
                                     f"exceeds max_model_len ({limit})")
        check_pool(p, params, self.pool)
        return (CoreRequest(request_id, ids, params, priority, states),
                prompt if isinstance(prompt, str) else None)


def sampling_params(params: Union[SamplingParams, Mapping[str, Any], None]) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, Mapping):
        return SamplingParams.model_validate(dict(params))
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"params: expected SamplingParams, got {type(params).__name__}")
    return params


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
