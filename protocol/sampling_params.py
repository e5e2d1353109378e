"""Per-request sampling parameters, with vLLM's field names: the ``params`` map of a job.

This is the one schema of sampling parameters. It lives in the producer SDK because it is part of
the wire contract: the SDK validates ``params`` with it before a job is sent, the worker validates
the same map with it when the job arrives (``protocol.decode_job``), and the engine runs with it
(``engine.SamplingParams`` re-exports this class). It imports nothing heavier than pydantic, so a
web backend that installs only the SDK never pulls in torch or the engine.

Types are strict (``strict=True``): ``"max_tokens": "5"``, ``"ignore_eos": "yes"`` or
``"seed": True`` are errors, not silent coercions, because producers in other languages must get
the same answer from every worker version. Integers are accepted for float fields.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from pydantic import (BaseModel, ConfigDict, Field, field_serializer, field_validator,
                      model_validator)

from tokenrelay.protocol.structured_outputs import StructuredOutputsParams


# The schema's own ceiling on ``n`` and ``beam_width``; engines and workers set lower bounds of
# their own (EngineConfig.max_n / max_beam_width, the worker's Limits).
MAX_N = 256

# Beam search is deterministic: it scores every continuation by log-probability. Fields that
# shape sampling or stopping in ways it cannot honour are refused with it instead of ignored.
NOT_WITH_BEAM_SEARCH = ("stop", "stop_token_ids", "logprobs", "repetition_penalty",
                         "presence_penalty", "frequency_penalty", "logit_bias")

# OpenAI's bounds on ``logit_bias``: at most this many entries, each bias in [-BOUND, BOUND].
MAX_LOGIT_BIAS_ENTRIES = 300
LOGIT_BIAS_BOUND = 100.0
# A token id key longer than this many digits cannot be in any vocabulary (the engine checks
# the real bound): refused here so a key of a million digits costs nothing to parse.
_MAX_TOKEN_ID_DIGITS = 10

# What a completion job without ``max_tokens`` generates: OpenAI's completions default.
DEFAULT_MAX_TOKENS = 16


def default_max_tokens(chat: bool, room: int, model_default: Optional[int] = None) -> int:
    """The ``max_tokens`` of a job that set none (docs/protocol.md, Jobs), decided here alone
    because the producer that budgets the job (``protocol.budget``) and the worker that runs it
    (worker/admission.py) must agree. ``room`` is what the context leaves after the prompt
    (``max_model_len`` minus prompt tokens; 0 or less when the prompt fills it).
    ``model_default`` (generation_config.json's ``max_new_tokens``) wins, capped to the room as
    vLLM caps it; without one a chat job runs to the end of the context, as OpenAI's and vLLM's
    chat endpoints do, and a completion gets ``DEFAULT_MAX_TOKENS``. Not floored: the worker
    needs at least 1, a token budget at least 0."""
    if model_default is not None:
        return min(model_default, room)
    return room if chat else DEFAULT_MAX_TOKENS


def min_tokens_fit(min_tokens: int, max_tokens: int) -> bool:
    """Whether a job may stop by ``max_tokens`` only after ``min_tokens`` (the one rule: the
    schema refuses a job breaking it, the worker applies no default that would)."""
    return min_tokens <= max_tokens


class SamplingParams(BaseModel):
    """How to sample one request. ``temperature == 0`` means greedy.

    Unknown fields are rejected (``extra="forbid"``) so a typo such as ``max_token`` fails loudly
    instead of silently falling back to a default.
    """

    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True, strict=True)

    n: int = Field(default=1, ge=1, le=MAX_N,
                   description="Sampled completions (choices) of one prompt; its blocks are shared.")
    beam_width: Optional[int] = Field(
        default=None, ge=1, le=MAX_N,
        description="Beam search with this many beams instead of sampling (all are returned, "
                    "best first); None samples.")
    length_penalty: float = Field(default=1.0, ge=-10.0, le=10.0,
                                  description="Beam search: score = cum_logprob / len**this.")
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, description="-1 (or 0) disables top-k.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: Optional[int] = Field(default=None, ge=0, lt=2**63)
    max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    skip_special_tokens: bool = True
    logit_bias: Optional[dict[int, float]] = Field(
        default=None,
        description="OpenAI's logit_bias: token id (an integer, or its decimal string as JSON "
                    f"keys are) -> bias in [-{LOGIT_BIAS_BOUND:g}, {LOGIT_BIAS_BOUND:g}] added to "
                    f"that token's logit before sampling; at most {MAX_LOGIT_BIAS_ENTRIES} "
                    "entries. Ids are checked against the model's vocabulary by the engine.")
    structured_outputs: Optional[StructuredOutputsParams] = Field(
        default=None,
        description="Constrain the output to a JSON schema, any JSON object, a regex, a choice "
                    "or a grammar (vLLM's StructuredOutputsParams; protocol/structured_outputs.py).")

    @field_validator("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "length_penalty")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number (got NaN or infinity)")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError("must be -1 or 0 (disabled) or a positive integer")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> list[str]:
        """A single string or a list of strings; anything else (5, 5.0, True, a map) is a
        ValueError so it reaches the caller as a validation error naming ``stop``."""
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, (list, tuple)):
            raise ValueError(f"must be a string or a list of strings, got {type(v).__name__}")
        if any(not isinstance(s, str) or s == "" for s in v):
            raise ValueError("stop strings must be non-empty strings")
        return list(v)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative")
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, v: Any) -> Optional[dict[int, float]]:
        """OpenAI's map from token id to bias. JSON keys are strings (``{"50256": -100}``), so a
        decimal string key is that id; an empty map is no bias (None), so that defaults compare
        equal whichever way "no bias" was spelled."""
        if v is None:
            return None
        if not isinstance(v, dict):
            raise ValueError(f"must be a map of token id to bias, got {type(v).__name__}")
        if len(v) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"has {len(v)} entries, over OpenAI's limit of "
                             f"{MAX_LOGIT_BIAS_ENTRIES}")
        out = {_token_id_key(k): _bias_value(k, b) for k, b in v.items()}
        if len(out) != len(v):
            raise ValueError("names a token id twice (as an integer and as a string)")
        return out or None

    @field_serializer("logit_bias")
    def _logit_bias_out(self, v: Optional[dict[int, float]]) -> Optional[dict[str, float]]:
        """On the wire the keys are strings, as in OpenAI's JSON: a msgpack reader in any
        language (most refuse integer map keys by default) reads the job's params."""
        return None if v is None else {str(k): b for k, b in v.items()}

    @model_validator(mode="after")
    def _min_le_max(self) -> "SamplingParams":
        # Unset, max_tokens depends on the job (a chat job runs to the end of the context:
        # worker/admission.py resolve_max_tokens sets it, and this check runs again then).
        if "max_tokens" in self.model_fields_set and \
                not min_tokens_fit(self.min_tokens, self.max_tokens):
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.beam_width is not None:
            if self.n not in (1, self.beam_width):
                raise ValueError(f"n ({self.n}) with beam_width ({self.beam_width}): beam search "
                                 f"returns all beam_width beams; leave n at 1")
            defaults = type(self).model_fields
            bad = [f for f in NOT_WITH_BEAM_SEARCH
                   if getattr(self, f) != defaults[f].get_default(call_default_factory=True)]
            if bad:
                raise ValueError(f"beam_width: beam search does not take {bad}")
        elif self.length_penalty != 1.0:
            raise ValueError("length_penalty applies to beam search only (set beam_width)")
        if self.structured_outputs is not None and self.ignore_eos:
            # The grammar ends the answer with EOS once it is complete; without EOS a complete
            # answer could only run on into tokens the grammar forbids.
            raise ValueError("ignore_eos: cannot be combined with structured_outputs (a "
                             "complete answer ends with EOS)")
        return self

    @property
    def use_beam_search(self) -> bool:
        return self.beam_width is not None

    @property
    def num_choices(self) -> int:
        """How many outputs the request returns: the beams, or the n samples."""
        return self.beam_width if self.beam_width is not None else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """A penalty reads the tokens drawn so far, so the next draw needs them on the host."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


def _token_id_key(key: Any) -> int:
    """A ``logit_bias`` key: a non-negative integer, or its decimal digits as a string."""
    if isinstance(key, str) and key.isascii() and key.isdigit() \
            and len(key) <= _MAX_TOKEN_ID_DIGITS:
        return int(key)
    if type(key) is int and 0 <= key < 10 ** _MAX_TOKEN_ID_DIGITS:
        return key
    raise ValueError(f"key {key!r:.40} is not a token id (a non-negative integer, as a decimal "
                     f"string in JSON)")


def _bias_value(key: Any, bias: Any) -> float:
    """A ``logit_bias`` value: a finite number in OpenAI's [-100, 100] (a bool is no number)."""
    if isinstance(bias, bool) or not isinstance(bias, (int, float)):
        raise ValueError(f"bias of token {key!r:.40} must be a number, got "
                         f"{type(bias).__name__}")
    if not (math.isfinite(bias) and -LOGIT_BIAS_BOUND <= bias <= LOGIT_BIAS_BOUND):
        raise ValueError(f"bias of token {key!r:.40} is {bias!r:.40}, outside "
                         f"[-{LOGIT_BIAS_BOUND:g}, {LOGIT_BIAS_BOUND:g}]")
    return float(bias)


SAMPLING_FIELDS = frozenset(SamplingParams.model_fields)
