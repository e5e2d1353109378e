"""What the engine hands out: per-step deltas (step API) and whole results (``LLM.generate``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Union


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


def merge_deltas(deltas: list[RequestDelta]) -> list[RequestDelta]:
    """One delta per choice from several steps' deltas, in order: the tokens, text and
    logprobs joined, the rest the latest's. A front end reading a core that ran ahead
    (engine/core_client.py) hands the caller one delta per choice, as one step does."""
    by_choice: dict[tuple[str, int], list[RequestDelta]] = {}
    for d in deltas:
        by_choice.setdefault((d.request_id, d.index), []).append(d)
    if len(by_choice) == len(deltas):
        return deltas
    return [ds[0] if len(ds) == 1 else _joined(ds) for ds in by_choice.values()]


def _joined(ds: list[RequestDelta]) -> RequestDelta:
    last = ds[-1]
    logprobs = None
    if last.logprobs is not None:
        logprobs = [lp for d in ds if d.logprobs is not None for lp in d.logprobs]
    return RequestDelta(
        request_id=last.request_id,
        new_token_ids=[t for d in ds for t in d.new_token_ids],
        new_text="".join(d.new_text for d in ds), logprobs=logprobs,
        token_logprobs=[lp for d in ds for lp in d.token_logprobs], finished=last.finished,
        finish_reason=last.finish_reason, stop_reason=last.stop_reason,
        num_prompt_tokens=last.num_prompt_tokens, num_output_tokens=last.num_output_tokens,
        index=last.index, cumulative_logprob=last.cumulative_logprob, error=last.error)


@dataclass(slots=True)
class CoreRequest:
    """A checked request as the engine core takes it: token ids only (the front end,
    engine/llm_engine.py or engine/core_client.py, tokenized and checked it). ``resume``: one
    state per choice, or None for a fresh start; the core reads only their token ids and
    whether the choice already finished (the text is the front end's)."""

    request_id: str
    prompt_token_ids: list[int]
    params: Any
    priority: int = 0
    resume: Optional[list[ResumeState]] = None
    owner: Optional[str] = None         # the job's producer: whose turn its grammar compile takes


class CoreOutput(NamedTuple):
    """What one core step produced for one choice: token ids, never text (the engine core
    works in ids; engine/output_processor.py turns them into ``RequestDelta``s).

    ``text_ends``: the last new token ends the choice and is not text (a stop token, EOS).
    ``whole``: a finished beam (``new_token_ids`` is its whole output, decoded afresh).
    ``ends_request``: the request's last live choice ended here (the core forgot it).
    ``error``: the core ended the request alone (its grammar); nothing else is set.

    A named tuple: it crosses the process boundary (engine/core_wire.py) many times a step,
    and a tuple pickles and builds several times faster than an object.
    """

    request_id: str
    index: int
    new_token_ids: list[int]
    token_logprobs: list[float]
    logprobs: Optional[list[Any]]
    finish_reason: Optional[str]
    stop_reason: Union[str, int, None]
    num_prompt_tokens: int
    num_output_tokens: int
    cumulative_logprob: Optional[float]
    text_ends: bool = False
    whole: bool = False
    ends_request: bool = False
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
