"""What the engine hands out: per-step deltas (step API) and whole results (``LLM.generate``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class ResumeState:
    """Continue a request another process started.

    The engine prefills prompt + ``output_token_ids`` and samples the next position exactly as
    the first process would have; text deltas continue right after ``output_text``.
    """

    output_token_ids: list[int]
    output_text: str
    # Set when this choice had already finished (its last event was delivered): it is not run.
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None


@dataclass
class RequestError:
    """Why the engine ended one request on its own, after ``add_request`` accepted it (its
    grammar failed to compile or timed out, its matcher failed): ``code`` is a protocol error
    code (``invalid_request``), ``message`` names the field (``params.structured_outputs``)."""

    code: str
    message: str


@dataclass
class RequestDelta:
    """What one step produced for one choice of one request (at most one per choice per step).

    A request with ``n`` choices ends when each choice has had its ``finished`` delta. Beam
    search requests return nothing until the search ends, then one delta per beam, best first
    (``index`` = rank), each holding the whole beam.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str                                   # incremental, UTF-8 safe, stops trimmed
    logprobs: Optional[list[dict[int, float]]]      # per new token, when requested
    token_logprobs: list[float]                     # logprob of each chosen token
    finished: bool
    finish_reason: Optional[str]                    # "stop" | "length" | None while running
    stop_reason: Union[str, int, None]              # the stop string or token id that matched
    num_prompt_tokens: int
    num_output_tokens: int                          # total so far, resumed ones included
    index: int = 0                                  # the choice (sample or beam rank)
    cumulative_logprob: Optional[float] = None      # of this choice's output so far
    # Set on the one delta of a request the engine ended with an error: no tokens, finished,
    # no finish_reason, and nothing follows for that request (its blocks are already freed).
    error: Optional[RequestError] = None


@dataclass
class StepCounters:
    """Statistics of the steps, counted by whichever core ran them (the serial step or the
    overlapped one, engine/overlap.py): both add to the one object the engine publishes."""

    num_steps: int = 0
    num_generated_tokens: int = 0
    num_computed_tokens: int = 0


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.time()`` seconds)."""

    arrival_time: float
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None

    @property
    def time_to_first_token(self) -> Optional[float]:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[list[dict[int, float]]]
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
