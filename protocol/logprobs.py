"""Token log-probabilities as a producer reads them: each token with its text and bytes.

OpenAI's logprobs name every token by its text (``token``) and UTF-8 ``bytes``, beside the
log-probability and the ``top_logprobs`` alternatives; token ids alone cannot be turned into
those without the model's tokenizer, which producers do not have. So the worker, which has it,
sends the text of every token it reports, and the SDK hands out ``TokenLogprob`` records that
``producer_sdk.openai.format`` maps onto OpenAI's shapes (chat ``ChatCompletionTokenLogprob``,
completions ``Logprobs``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TopLogprob(BaseModel):
    """One alternative at a position (the chosen token is among them too)."""

    model_config = ConfigDict(frozen=True)

    token_id: int
    token: str                          # the token's text (as the tokenizer decodes it alone)
    bytes: list[int] = Field(default_factory=list)   # its UTF-8 bytes (a partial character too)
    logprob: float


class TokenLogprob(BaseModel):
    """The chosen token at one output position, and the top alternatives asked for."""

    model_config = ConfigDict(frozen=True)

    token_id: int
    token: str
    bytes: list[int] = Field(default_factory=list)
    logprob: float
    top_logprobs: list[TopLogprob] = Field(default_factory=list)   # best first


__all__ = ["TokenLogprob", "TopLogprob"]
