"""What a finished job is to the producer: ``Result`` (vLLM's ``RequestOutput``, named as
vLLM and OpenAI name its fields) with one ``CompletionOutput`` per choice, built from the fold
of its result stream and its ``done`` event (``job_outputs``)."""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from tokenrelay.protocol.events import DoneEvent, Timings, Usage
from tokenrelay.protocol.fold import ResultFold
from tokenrelay.protocol.logprobs import TokenLogprob


class CompletionOutput(BaseModel):
    """One choice of a finished job (sample i of ``n``, or the beam of rank i), named as
    vLLM's ``CompletionOutput``."""

    model_config = ConfigDict(frozen=True)

    index: int
    text: str
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[str, int]] = None
    cumulative_logprob: Optional[float] = None
    logprobs: Optional[list[dict[int, float]]] = None
    # the same logprobs with each token's text and bytes (OpenAI's shape); None when the job
    # did not ask for logprobs, or its worker predates logprob_tokens
    token_logprobs: Optional[list[TokenLogprob]] = None


class Result(BaseModel):
    """A finished job. ``finish_reason`` is stop, length or cancelled. ``outputs`` lists every
    choice (one unless ``n > 1`` or beam search), best beam first; ``text``, ``token_ids``,
    ``logprobs`` and ``token_logprobs`` are those of the first, ``usage.completion_tokens`` counts them all."""

    model_config = ConfigDict(frozen=True)

    job_id: str
    text: str
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: str
    usage: Usage = Field(default_factory=Usage)
    timings: Timings = Field(default_factory=Timings)
    metadata: dict[str, Any] = Field(default_factory=dict)
    logprobs: Optional[list[dict[int, float]]] = None
    token_logprobs: Optional[list[TokenLogprob]] = None
    stop_reason: Optional[Union[str, int]] = None
    attempts: int = 0
    outputs: list[CompletionOutput] = Field(default_factory=list)


def job_outputs(fold: ResultFold, done: DoneEvent) -> list[CompletionOutput]:
    """Every choice of a finished job: the streamed output of each (the fold), or the ``done``
    event's own (``stream=False``); why each finished from ``done.choices`` when it has them,
    else from the choice's last token event (choice 0: the ``done`` event itself)."""
    by_index = {c.index: c for c in (done.choices or ())}
    outputs = []
    for i in sorted(set(by_index) | set(fold.choices) | {0}):
        c, d = fold.choice(i), by_index.get(i)
        text, ids = c.text, c.token_ids
        if d is not None and d.text is not None:
            text, ids = d.text, list(d.token_ids or [])
        elif i == 0 and done.text is not None:
            text, ids = done.text, list(done.token_ids or [])
        if d is not None:
            reason, stop = d.finish_reason, d.stop_reason
        elif i == 0:
            reason, stop = done.finish_reason, done.stop_reason
        else:
            reason, stop = c.finish_reason, c.stop_reason
        cum = d.cumulative_logprob if d is not None and d.cumulative_logprob is not None \
            else c.cumulative_logprob
        outputs.append(CompletionOutput(index=i, text=text, token_ids=list(ids),
                                        finish_reason=reason, stop_reason=stop,
                                        cumulative_logprob=cum, logprobs=c.logprobs,
                                        token_logprobs=c.token_logprobs))
    return outputs


__all__ = ["CompletionOutput", "Result", "job_outputs"]
