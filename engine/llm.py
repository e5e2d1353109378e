"""LLM: the offline, vLLM-shaped front door (``LLM(model=PATH).generate(prompts, params)``)."""

from __future__ import annotations

import itertools
import time
from typing import Any, Mapping, Optional, Sequence as Seq, Union

from tokenrelay.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from tokenrelay.engine.config import EngineConfig
from tokenrelay.engine.errors import InvalidRequestError
from tokenrelay.engine.llm_engine import LLMEngine, PromptType
from tokenrelay.engine.outputs import CompletionOutput, RequestDelta, RequestMetrics, RequestOutput
from tokenrelay.engine.sampling_params import SamplingParams

ParamsType = Union[SamplingParams, Seq[SamplingParams], None]


class LLM:
    """Batch generation over an ``LLMEngine``. Keyword arguments are ``EngineConfig`` fields."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        model_object = kwargs.pop("model_object", None)
        tokenizer_object = kwargs.pop("tokenizer_object", None)
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs), model=model_object,
                                tokenizer=tokenizer_object)
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop a tensor-parallel engine's other ranks (see ``LLMEngine.shutdown``)."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    @staticmethod
    def _prompt_list(prompts: Any) -> list[PromptType]:
        """One prompt (text, token ids, or a prompt dict) or a list of them, as a list. A
        dict or any other object is never iterated as if it were a list of prompts."""
        if isinstance(prompts, (str, Mapping)):
            return [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(
                f"prompts: expected a prompt (str, list of token ids, {{'prompt': ...}} or "
                f"{{'prompt_token_ids': ...}}) or a list of prompts, got {type(prompts).__name__}")
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]
        return list(prompts)

    def generate(self, prompts: Union[PromptType, Seq[PromptType]], params: ParamsType = None,
                 use_tqdm: bool = False, *, sampling_params: ParamsType = None,
                 priority: Optional[Seq[int]] = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        ``prompts``: a string, a list of token ids, a prompt dict (vLLM's
        ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``), or a list of those. ``params``: one
        SamplingParams for all, or one per prompt. Bad input raises ValueError before anything
        runs (the requests of this call that were already queued are withdrawn).
        """
        if params is None:
            params = sampling_params
        prompts = self._prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError(f"params: got {len(params_list)} SamplingParams for "
                                 f"{len(prompts)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(prompts)
        return self._run(prompts, params_list, priorities, use_tqdm)

    def chat(self, messages: Union[list[dict], list[list[dict]]], params: ParamsType = None,
             use_tqdm: bool = False, *, sampling_params: ParamsType = None,
             chat_template_kwargs: Optional[Mapping[str, Any]] = None,
             tools: Optional[list[dict[str, Any]]] = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations;
        ``chat_template_kwargs`` go to the chat template (e.g. ``{"enable_thinking": False}``),
        and so do ``tools`` (OpenAI's function tools, as vLLM's ``LLM.chat`` takes them),
        refused when the template does not render tools."""
        if params is None:
            params = sampling_params
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts: list[PromptType] = []
        texts: list[str] = []
        for conv in convs:
            text = self.engine.render_chat(conv, chat_template_kwargs,  # type: ignore[arg-type]
                                           tools)
            texts.append(text)
            # The rendered template already holds BOS and friends: add no special tokens.
            prompts.append(list(tok.encode(text, add_special_tokens=False)))
        outs = self.generate(prompts, params, use_tqdm)
        for o, text in zip(outs, texts):
            o.prompt = text
        return outs

    def beam_search(self, prompts: Union[PromptType, Seq[PromptType]],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search over each prompt (vLLM's ``LLM.beam_search``): per prompt, the
        ``beam_width`` finished beams, best first, ranked as transformers'
        ``generate(num_beams=k, early_stopping=True)`` ranks them."""
        sp = SamplingParams(beam_width=params.beam_width, max_tokens=params.max_tokens,
                            ignore_eos=params.ignore_eos, length_penalty=params.length_penalty,
                            min_tokens=params.min_tokens, temperature=0.0)
        prompts = self._prompt_list(prompts)
        ids, runs = self._drive(prompts, [sp] * len(prompts), [0] * len(prompts), False)
        outputs = []
        for rid in ids:
            run = runs[rid]
            seqs = []
            for c in run.output(rid).outputs:
                score = c.cumulative_logprob / (len(c.token_ids) ** params.length_penalty)
                seqs.append(BeamSearchSequence(
                    token_ids=c.token_ids, text=c.text, cum_logprob=c.cumulative_logprob,
                    score=score, finish_reason=c.finish_reason, logprobs=run.token_logprobs[c.index]))
            outputs.append(BeamSearchOutput(seqs, run.prompt_token_ids, run.prompt))
        return outputs

    def _drive(self, prompts: list[PromptType], params_list: list[SamplingParams],
               priorities: list[int], use_tqdm: bool) -> tuple[list[str], dict[str, _Run]]:
        """Add every request, step until each has ended; (ids, each request's run: its
        prompt and its deltas with the time each arrived)."""
        engine = self.engine
        ids: list[str] = []
        runs: dict[str, _Run] = {}
        try:
            for prompt, p, prio in zip(prompts, params_list, priorities):
                rid = f"llm-{next(self._ids)}"
                engine.add_request(rid, prompt, p, priority=prio)
                ids.append(rid)
                text, prompt_ids, arrival = engine.request_prompt(rid)
                runs[rid] = _Run(text, prompt_ids, arrival, p)
        except Exception:
            for rid in ids:
                engine.abort_request(rid)
            raise
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generate", unit="req")
        pending = set(ids)
        while pending:
            now_deltas = engine.step()
            now = time.time()
            for d in now_deltas:
                run = runs.get(d.request_id)
                if run is None:
                    continue
                if d.error is not None:
                    self._abandon(pending, d)
                run.add(d, now)
                if run.done and d.request_id in pending:
                    pending.discard(d.request_id)
                    if bar is not None:
                        bar.update(1)
            if pending and not engine.has_unfinished_requests():
                raise RuntimeError("engine went idle with requests still pending")
        if bar is not None:
            bar.close()
        return ids, runs

    def _abandon(self, pending: set[str], failed: RequestDelta) -> None:
        """A request the engine ended with an error (its grammar did not compile in time, its
        matcher failed): as for a request refused at add time, the call raises, and the rest
        of its requests are withdrawn."""
        for rid in pending:
            self.engine.abort_request(rid)
        raise InvalidRequestError(f"request {failed.request_id}: {failed.error.message}")

    def _run(self, prompts: list[PromptType], params_list: list[SamplingParams],
             priorities: list[int], use_tqdm: bool) -> list[RequestOutput]:
        ids, runs = self._drive(prompts, params_list, priorities, use_tqdm)
        return [runs[rid].output(rid) for rid in ids]


class _Run:
    """One request of a ``generate`` call: its prompt, and its choices as the deltas built
    them (the engine keeps nothing of a request once it ended)."""

    def __init__(self, prompt: Optional[str], prompt_token_ids: list[int], arrival: float,
                 params: SamplingParams) -> None:
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.arrival = arrival
        self.params = params
        self.choices: dict[int, CompletionOutput] = {}
        self.token_logprobs: dict[int, list[float]] = {}
        self.ended: set[int] = set()
        self.first_token: Optional[float] = None
        self.last: Optional[float] = None

    @property
    def done(self) -> bool:
        return len(self.ended) >= self.params.num_choices

    def add(self, d: RequestDelta, now: float) -> None:
        if self.first_token is None and d.new_token_ids:
            self.first_token = now
        c = self.choices.get(d.index)
        if c is None:
            c = self.choices[d.index] = CompletionOutput(
                index=d.index, text="", token_ids=[], cumulative_logprob=None,
                logprobs=[] if d.logprobs is not None else None)
        c.text += d.new_text
        self.token_logprobs.setdefault(d.index, []).extend(d.token_logprobs)
        c.token_ids.extend(d.new_token_ids)
        c.cumulative_logprob = d.cumulative_logprob
        if d.logprobs is not None and c.logprobs is not None:
            c.logprobs.extend(d.logprobs)
        if d.finished:
            c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
            self.ended.add(d.index)
            self.last = now
            if self.params.use_beam_search:     # the search ends with every beam at once
                self.ended.update(range(self.params.num_choices))

    def output(self, rid: str) -> RequestOutput:
        return RequestOutput(
            request_id=rid, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            outputs=[self.choices[i] for i in sorted(self.choices)], finished=True,
            metrics=RequestMetrics(self.arrival, self.first_token, self.last))
