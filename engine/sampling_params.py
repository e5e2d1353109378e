"""Per-request sampling parameters, with vLLM's field names.

This module deliberately imports nothing heavier than pydantic: the producer SDK validates
sampling fields with this same model before a job is sent, and a web backend that installs only
the SDK must not pull in torch.
"""

from __future__ import annotations

import math
from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class SamplingParams(BaseModel):
    """How to sample one request. ``temperature == 0`` means greedy.

    Unknown fields are rejected (``extra="forbid"``) so a typo such as ``max_token`` fails loudly
    instead of silently falling back to a default.
    """

    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True)

    n: int = Field(default=1, ge=1, le=1, description="Completions per request (only 1 is supported).")
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, description="-1 (or 0) disables top-k.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    seed: Optional[int] = Field(default=None, ge=0, lt=2**63)
    max_tokens: int = Field(default=16, ge=1)
    min_tokens: int = Field(default=0, ge=0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    skip_special_tokens: bool = True

    @field_validator("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty")
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
    def _stop_list(cls, v: Union[str, list[str], None]) -> list[str]:
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if any(not isinstance(s, str) or s == "" for s in v):
            raise ValueError("stop strings must be non-empty strings")
        return list(v)

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative")
        return v

    @model_validator(mode="after")
    def _min_le_max(self) -> "SamplingParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
