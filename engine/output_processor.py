"""The output processor: the engine core's token ids become ``RequestDelta``s (vLLM v1's
output processor). It owns everything about text: incremental detokenization (its cost per
step is the new tokens', engine/detokenizer.py), stop strings, and the text of finished beams.

It runs beside the core for ``LLM.generate`` (engine/llm_engine.py) and in the worker's
process when the core has its own (engine/core_client.py). It keeps one small record per
live request; the core never sees text. A stop string ends a choice here first: ``process``
returns it in ``stops`` and the caller tells the core (``EngineCore.finish_choice``); any
tokens the core drew for that choice meanwhile are dropped here, so what the caller gets is
the same whether the core is in this process or another.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from tokenrelay.engine.detokenizer import IncrementalDetokenizer, detokenize_step
from tokenrelay.engine.outputs import CoreOutput, RequestDelta, ResumeState


@dataclass
class _Live:
    """One live request's text state: a detokenizer per choice, made when it first draws."""

    prompt_tail: list[int]
    params: Any
    open: set[int]
    resume: dict[int, ResumeState] = field(default_factory=dict)
    detoks: dict[int, IncrementalDetokenizer] = field(default_factory=dict)


@dataclass(frozen=True)
class Processed:
    """One step's deltas, the stop-string hits the core must hear of as (request id, choice
    index, stop string), and the requests that ended (every choice finished or an error)."""

    deltas: list[RequestDelta]
    stops: list[tuple[str, int, str]]
    ended: list[str]


class OutputProcessor:
    """Text deltas, stop strings and finish reasons for the core's outputs."""

    # Prompt tokens a detokenizer's window starts with (engine/detokenizer.py).
    _TAIL = 8

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.live: dict[str, _Live] = {}

    def add(self, request_id: str, prompt_token_ids: list[int], params: Any,
            resume: Optional[list[ResumeState]] = None) -> None:
        """Track a request the core was given. A resumed choice's detokenizer replays what
        another process emitted, so later deltas continue its text exactly."""
        width = params.num_choices
        states = dict(enumerate(resume)) if resume is not None else {}
        live = _Live(list(prompt_token_ids[-self._TAIL:]), params,
                     {i for i in range(width) if i not in states
                      or states[i].finish_reason is None}, states)
        self.live[request_id] = live

    def abort(self, request_id: str) -> bool:
        return self.live.pop(request_id, None) is not None

    def has(self, request_id: str) -> bool:
        return request_id in self.live

    def _detok(self, live: _Live, index: int) -> IncrementalDetokenizer:
        d = live.detoks.get(index)
        if d is None:
            d = live.detoks[index] = IncrementalDetokenizer(self.tokenizer, live.prompt_tail,
                                                            live.params)
            state = live.resume.get(index)
            if state is not None and state.output_token_ids:
                d.replay(list(state.output_token_ids), state.output_text)
        return d

    def process_steps(self, steps: list[list[CoreOutput]]) -> Processed:
        """Several core steps' outputs at once (a core in another process that ran ahead of
        this one). A choice whose request has no stop strings is detokenized once for all its
        new tokens: the detokenizer's deltas join to the same text whether it takes the tokens
        one step at a time or together, and no text can end such a choice early. So a front end
        that fell behind pays once per choice per call, not once per step, and catches up.
        Choices with stop strings (whose tokens after a hit must be dropped), beams, errors go
        step by step, as ``process``."""
        if len(steps) == 1:
            return self.process(steps[0])
        joined: dict[tuple[str, int], CoreOutput] = {}
        each: list[list[CoreOutput]] = []
        for outs in steps:
            rest = []
            for o in outs:
                live = self.live.get(o.request_id)
                if live is None or live.params.stop or o.whole or o.error is not None:
                    rest.append(o)
                    continue
                key = (o.request_id, o.index)
                before = joined.get(key)
                joined[key] = o if before is None else join_outputs(before, o)
            each.append(rest)
        done = [self.process(list(joined.values()))] + [self.process(r) for r in each if r]
        return Processed([d for p in done for d in p.deltas], [s for p in done for s in p.stops],
                         [e for p in done for e in p.ended])

    def process(self, outs: list[CoreOutput]) -> Processed:
        """Detokenize one core step's outputs in one batched pass and apply stop strings.
        Outputs of requests no longer live here (aborted, or a choice a stop string ended
        while the core ran ahead) are dropped."""
        items: list[tuple[IncrementalDetokenizer, list[int], bool]] = []
        kept: list[tuple[CoreOutput, _Live]] = []
        deltas: list[RequestDelta] = []
        ended: list[str] = []
        for o in outs:
            live = self.live.get(o.request_id)
            if live is None:
                continue
            if o.error is not None:
                deltas.append(_error_delta(o))
                del self.live[o.request_id]
                ended.append(o.request_id)
                continue
            if o.index not in live.open:
                continue
            if o.whole:         # a finished beam: its whole output, decoded afresh
                d = IncrementalDetokenizer(self.tokenizer, live.prompt_tail, live.params)
            else:
                d = self._detok(live, o.index)
            text_ids = o.new_token_ids[:-1] if o.text_ends else o.new_token_ids
            items.append((d, text_ids, o.finish_reason is not None))
            kept.append((o, live))
        stops: list[tuple[str, int, str]] = []
        for (o, live), (text, stop_str) in zip(kept, detokenize_step(items)):
            reason, stop_reason = o.finish_reason, o.stop_reason
            if stop_str is not None and not o.whole:
                if reason is None:
                    stops.append((o.request_id, o.index, stop_str))
                reason, stop_reason = "stop", stop_str
            deltas.append(RequestDelta(
                request_id=o.request_id, new_token_ids=o.new_token_ids, new_text=text,
                logprobs=o.logprobs, token_logprobs=o.token_logprobs,
                finished=reason is not None, finish_reason=reason, stop_reason=stop_reason,
                num_prompt_tokens=o.num_prompt_tokens, num_output_tokens=o.num_output_tokens,
                index=o.index, cumulative_logprob=o.cumulative_logprob))
            if reason is not None and not o.whole:
                live.open.discard(o.index)
                live.detoks.pop(o.index, None)
            if (o.ends_request or not live.open) and o.request_id in self.live:
                del self.live[o.request_id]
                ended.append(o.request_id)
        return Processed(deltas, stops, ended)


def join_outputs(a: CoreOutput, b: CoreOutput) -> CoreOutput:
    """One choice's outputs of two consecutive core steps as one: the tokens and logprobs
    joined, the rest (finish, counts) the later's."""
    logprobs = None if a.logprobs is None and b.logprobs is None else \
        (a.logprobs or []) + (b.logprobs or [])
    return b._replace(new_token_ids=a.new_token_ids + b.new_token_ids,
                      token_logprobs=a.token_logprobs + b.token_logprobs, logprobs=logprobs)


def _error_delta(o: CoreOutput) -> RequestDelta:
    return RequestDelta(request_id=o.request_id, new_token_ids=[], new_text="", logprobs=None,
                        token_logprobs=[], finished=True, finish_reason=None, stop_reason=None,
                        num_prompt_tokens=o.num_prompt_tokens, num_output_tokens=0,
                        error=o.error)
