"""LLMEngine: the step API (add_request / step / abort_request) the worker drives.

One ``step()`` = admit requests whose grammar is ready -> schedule -> one forward pass ->
mask and sample -> detokenize -> finish checks. The engine's only threads are the grammar
compiler's (engine/grammar.py, started by the first constrained request); its only queues
besides the scheduler's hold requests waiting for a grammar. The caller decides when to step. See docs/contracts.md for the contract this implements.
"""

from __future__ import annotations

import itertools
import random
import time
from typing import Any, Callable, Mapping, Optional, Sequence as Seq, Union

import torch

from tokenrelay.engine.beam_search import BeamSearch
from tokenrelay.engine.block_manager import BlockManager
from tokenrelay.engine.config import EngineConfig
from tokenrelay.engine.detokenizer import IncrementalDetokenizer
from tokenrelay.engine.errors import InvalidRequestError, PromptTooLongError
from tokenrelay.engine.forks import advance_beams, beam_deltas, branch_seed, fork_samples
from tokenrelay.engine.grammar import GrammarError
from tokenrelay.engine.model_runner import ModelRunner
from tokenrelay.engine.output_processor import OutputProcessor
from tokenrelay.engine.overlap import OverlappedCore
from tokenrelay.engine.outputs import RequestDelta, RequestError, ResumeState, StepCounters
from tokenrelay.engine.prompts import (PromptType, check_chat_template_kwargs, prompt_of, render_chat,
                            tool_call_format)
from tokenrelay.protocol.sampling_params import min_tokens_fit
from tokenrelay.protocol.tools import NO_TOOLS
from tokenrelay.engine.request_checks import check_pool, check_width, resume_states
from tokenrelay.engine.request_checks import prompt_ids as prompt_ids_of
from tokenrelay.engine.sampler import Sampler
from tokenrelay.engine.sampling_params import SamplingParams
from tokenrelay.engine.scheduler import Scheduler
from tokenrelay.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from tokenrelay.engine.structured import StructuredOutputs

__all__ = ["LLMEngine", "PromptType", "check_chat_template_kwargs", "prompt_of"]


def _eos_ids(config: EngineConfig, tokenizer: Any) -> set[int]:
    """EOS ids: config.json's and generation_config.json's ``eos_token_id`` (int or list, read
    by ModelConfig) plus the tokenizer's."""
    ids = set(config.hf_config.eos_token_ids)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    return ids


def engine_stats(scheduler: Scheduler, counters: StepCounters, max_model_len: int,
                 structured: dict[str, Any]) -> dict[str, Any]:
    """The flat statistics ``LLMEngine.stats`` publishes."""
    sched = scheduler.stats()
    kv = sched.kv
    return {
        "num_preemptions": sched.num_preemptions,
        "kv_blocks_total": kv.blocks_total,
        "kv_blocks_used": kv.blocks_used,
        "kv_blocks_shared": scheduler.block_manager.num_shared_blocks(),
        "kv_blocks_peak": sched.kv_blocks_peak,
        "kv_utilization_peak": sched.kv_utilization_peak,
        "prefix_cache_hit_rate": kv.prefix_cache_hit_rate,
        "prefix_cache_hit_tokens": kv.prefix_cache_hit_tokens,
        "prefix_cache_query_tokens": kv.prefix_cache_query_tokens,
        "num_running": sched.num_running,
        "num_waiting": sched.num_waiting,
        "num_running_peak": sched.num_running_peak,
        "num_steps": counters.num_steps,
        "num_generated_tokens": counters.num_generated_tokens,
        "num_computed_tokens": counters.num_computed_tokens,
        "block_size": kv.block_size,
        "max_model_len": max_model_len,
        **structured,
    }


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    ``model``/``tokenizer`` may be injected (tests use a fake model); by default they are
    loaded from ``config.model`` with ``engine.loader``. ``on_parallel_failure(message)`` is
    called once if a rank of a tensor-parallel engine dies or a collective fails (after which
    every step raises ``TensorParallelError``); the worker exits there.
    """

    def __init__(self, config: EngineConfig, *, model: Optional[Any] = None,
                 tokenizer: Optional[Any] = None,
                 on_parallel_failure: Optional[Callable[[str], None]] = None) -> None:
        self.config = config.resolve()
        if tokenizer is None:
            from tokenrelay.engine.loader import load_tokenizer
            tokenizer = load_tokenizer(config.model)
        self.tokenizer = tokenizer
        self.model_runner = ModelRunner(config, model, on_parallel_failure=on_parallel_failure)
        self.vocab_size = config.hf_config.vocab_size
        self.max_model_len: int = config.max_model_len  # type: ignore[assignment]
        self.block_manager = BlockManager(self.model_runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   typical_request_tokens=min(self.max_model_len, 512))
        self.eos_token_ids = _eos_ids(config, tokenizer)
        self.sampler = Sampler(self.vocab_size, sorted(self.eos_token_ids))
        self.structured = StructuredOutputs(tokenizer, self.vocab_size, self.eos_token_ids,
                                            threads=config.grammar_compile_threads,
                                            timeout_s=config.grammar_compile_timeout_s)
        self.outputs = OutputProcessor(self.scheduler, self.eos_token_ids, self.max_model_len)
        self.counters = StepCounters()
        self.overlap: Optional[OverlappedCore] = None
        if self.config.async_scheduling:
            self.overlap = OverlappedCore(scheduler=self.scheduler, runner=self.model_runner,
                                          sampler=self.sampler, outputs=self.outputs,
                                          counters=self.counters,
                                          max_model_len=self.max_model_len)
        self.requests: dict[str, SequenceGroup] = {}
        self._seed_rng = random.Random(config.seed)
        self._arrivals = itertools.count()
        self._tool_format: Optional[str] = None

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "LLMEngine":
        model = kwargs.pop("model_object", None)
        tokenizer = kwargs.pop("tokenizer_object", None)
        return cls(EngineConfig(**kwargs), model=model, tokenizer=tokenizer)

    # -- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType,
                    params: Union[SamplingParams, Mapping[str, Any], None] = None,
                    priority: int = 0,
                    resume: Union[ResumeState, Seq[ResumeState], None] = None,
                    owner: Optional[str] = None) -> None:
        """Queue a request. Raises InvalidRequestError / PromptTooLongError (with the numbers)
        or pydantic's ValidationError for bad sampling fields; on error nothing is changed.

        ``resume``: for ``n == 1`` a ResumeState; for ``n > 1`` one per choice (a choice with
        ``finish_reason`` set already ended and is not run). Beam search is never resumed.

        A request with ``structured_outputs`` waits outside the scheduler until its grammar is
        compiled (engine/structured.py); a spec known to fail raises GrammarError here.
        ``owner`` (the job's producer) is whose turn its compile takes (engine/compile_queue.py)."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id: must be a non-empty string")
        if request_id in self.requests:
            raise InvalidRequestError(f"request_id: {request_id!r} is already in use")
        if params is None:
            params = SamplingParams()
        elif isinstance(params, Mapping):
            params = SamplingParams.model_validate(dict(params))
        elif not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                f"params: expected SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority: must be an integer, got {priority!r}")
        if not min_tokens_fit(params.min_tokens, params.max_tokens):   # the schema checks it only when set
            raise InvalidRequestError(f"min_tokens: {params.min_tokens} exceeds max_tokens "
                                      f"({params.max_tokens})")
        check_width(params, self.config)
        prompt = prompt_of(prompt)
        prompt_ids = prompt_ids_of(prompt, self.tokenizer, self.vocab_size)
        states = resume_states(resume, params, self.vocab_size)
        p, m = len(prompt_ids), params.max_tokens
        if p + m > self.max_model_len:
            raise PromptTooLongError(
                f"prompt ({p} tokens) + max_tokens ({m}) = {p + m} exceeds max_model_len "
                f"({self.max_model_len})")
        check_pool(p, params, self.block_manager)

        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        beam = None
        if params.use_beam_search:
            beam = BeamSearch(params.num_choices, length_penalty=params.length_penalty,
                              eos_token_ids=sorted(self.eos_token_ids),
                              ignore_eos=params.ignore_eos, max_tokens=m,
                              min_tokens=params.min_tokens)
        group = SequenceGroup(request_id, params.num_choices, params=params, seed=seed, beam=beam)
        arrival = next(self._arrivals)
        text = prompt if isinstance(prompt, str) else None
        runs = [(0, None)] if states is None else [
            (i, st) for i, st in enumerate(states) if st.finish_reason is None]
        group.forked = group.forked or states is not None
        seqs = []
        for index, state in runs:
            seq = Sequence(request_id, prompt_ids, params, priority=priority,
                           arrival_index=arrival, seed=branch_seed(seed, index), prompt=text,
                           index=index, group=group)
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params)
            if state is not None and state.output_token_ids:
                seq.token_ids.extend(state.output_token_ids)
                seq.detokenizer.replay(list(state.output_token_ids), state.output_text)
            seqs.append(seq)
        if params.structured_outputs is not None:
            self.structured.add(request_id, params.structured_outputs, seqs, owner=owner)
        self.requests[request_id] = group
        if params.structured_outputs is None:
            for seq in seqs:
                self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> bool:
        """Drop a request in any state and free its blocks at once. Silent: no delta follows."""
        group = self.requests.pop(request_id, None)
        if group is None:
            return False
        self._drop(group, scheduled=not self.structured.abort(request_id))
        return True

    def _drop(self, group: SequenceGroup, scheduled: bool) -> None:
        """Finish every live sequence of a request taken out of ``self.requests``; one still
        waiting for its grammar never reached the scheduler."""
        now = time.time()
        for seq in list(group.seqs):
            if scheduled:
                self.scheduler.finish(seq, "abort")
            else:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                group.seqs.remove(seq)
            seq.finished_time = now

    def _fail_request(self, request_id: str, exc: Exception,
                      scheduled: bool = True) -> RequestDelta:
        """End a request the engine accepted with an error: its one, last delta."""
        group = self.requests.pop(request_id, None)
        seqs = list(group.seqs) + list(group.finished.values()) if group is not None else []
        if group is not None:
            self._drop(group, scheduled)
        return RequestDelta(
            request_id=request_id, new_token_ids=[], new_text="", logprobs=None,
            token_logprobs=[], finished=True, finish_reason=None, stop_reason=None,
            num_prompt_tokens=seqs[0].num_prompt_tokens if seqs else 0,
            num_output_tokens=0, error=RequestError(getattr(exc, "code", "invalid_request"),
                                                    str(exc)))

    def request_seed(self, request_id: str) -> int:
        """The sampling seed of a live request (drawn at add time when it gave none)."""
        group = self.requests.get(request_id)
        if group is None:
            raise KeyError(f"no unfinished request {request_id!r}")
        return group.seed

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self.structured.waiting)
                or (self.overlap is not None and self.overlap.flight is not None))

    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    def free_capacity(self) -> int:
        """How many more requests could start soon (see Scheduler.free_capacity)."""
        return max(0, self.scheduler.free_capacity() - len(self.structured.waiting))

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Run one scheduling step; return at most one delta per request that got a token
        (and the error delta of each request the engine ended: see RequestDelta.error)."""
        deltas = self._admit_constrained()
        if self.overlap is not None:
            if self.overlap.eligible():
                return deltas + self._take(*self.overlap.step())
            deltas.extend(self._take(*self.overlap.drain()))
        if not self.scheduler.has_unfinished():
            return deltas
        out = self.scheduler.schedule()
        if out.is_empty:
            return deltas
        logits, rows = self.model_runner.execute(out.seqs, out.num_new_tokens, out.block_copies)
        self.scheduler.update(out)
        self.counters.num_steps += 1
        self.counters.num_computed_tokens += out.num_batched_tokens
        if not rows:
            return deltas
        sample_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        beam_rows: dict[int, tuple[SequenceGroup, dict[int, int]]] = {}
        for row, i in enumerate(rows):
            seq = out.seqs[i]
            group = seq.group
            if group.beam is not None:
                beam_rows.setdefault(id(group), (group, {}))[1][id(seq)] = row
                continue
            branches = [seq] if group.forked else fork_samples(seq, self.scheduler,
                                                               self.tokenizer)
            sample_seqs.extend(branches)
            sample_rows.extend([row] * len(branches))
        if sample_seqs:
            if len(sample_rows) != logits.shape[0] or sample_rows != list(range(len(sample_rows))):
                logits_s = logits[torch.tensor(sample_rows, device=logits.device)]
            else:
                logits_s = logits
            masks, broken = self.structured.masks(sample_seqs, logits.device)
            failed = {s.request_id: GrammarError(s.constraint.error() or "matcher failed")
                      for s in broken}
            sampled = self.sampler(logits_s, sample_seqs, masks)
            deltas.extend(self._take(*self.outputs.process(sample_seqs, sampled, failed,
                                                           time.time())))
            deltas.extend(self._fail_request(rid, exc) for rid, exc in failed.items())
        for group, by_seq in beam_rows.values():
            deltas.extend(self._beam_step(group, by_seq, logits))
        return deltas

    def _take(self, done: list[RequestDelta], ended: list[str]) -> list[RequestDelta]:
        """Account for processed deltas; forget the requests whose last choice ended."""
        for request_id in ended:
            del self.requests[request_id]
        self.counters.num_generated_tokens += len(done)
        return done

    def _admit_constrained(self) -> list[RequestDelta]:
        """Constrained requests whose matchers are ready go to the scheduler; those whose
        grammar failed or timed out end here. Waits briefly when nothing else could run."""
        if not self.structured.waiting:
            return []
        polled = self.structured.poll(block=not self.scheduler.has_unfinished())
        for seq in polled.ready:
            self.scheduler.add(seq)
        return [self._fail_request(rid, exc, scheduled=False) for rid, exc in polled.failed]

    def _beam_step(self, group: SequenceGroup, rows: dict[int, int],
                   logits: torch.Tensor) -> list[RequestDelta]:
        """Rank the beams' continuations; fork and free beams, or return the finished beams."""
        order = [rows[id(s)] for s in group.seqs]
        logprobs = torch.log_softmax(logits[torch.tensor(order, device=logits.device)].float(),
                                     dim=-1).cpu()
        masks, broken = self.structured.masks(group.seqs, logprobs.device)
        if broken:
            return [self._fail_request(group.request_id,
                                       GrammarError(broken[0].constraint.error() or ""))]
        if masks is not None:     # as transformers' logits processors: on the log-softmax
            logprobs[masks.rows] = logprobs[masks.rows].masked_fill(~masks.allowed,
                                                                    float("-inf"))
        beam = group.beam
        num_prompt = group.seqs[0].num_prompt_tokens
        at_limit = (beam.gen_len + 1 >= group.params.max_tokens
                    or num_prompt + beam.gen_len + 1 >= self.max_model_len)
        step = beam.step(logprobs, length_limit=at_limit)
        now = time.time()
        if not step.done:
            refused = advance_beams(group, step, self.scheduler)
            return [] if refused is None else [self._fail_request(group.request_id,
                                                                  GrammarError(refused))]
        deltas = beam_deltas(group, self.scheduler, self.tokenizer)
        group.finished_time = now
        del self.requests[group.request_id]
        self.counters.num_generated_tokens += sum(len(d.new_token_ids) for d in deltas)
        return deltas

    def shutdown(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (also done when it is garbage
        collected or the process exits); nothing to do at size 1. Stops the overlapped core's
        device thread (CPU) after its step in flight."""
        if self.overlap is not None:
            self.overlap.shutdown()
        self.model_runner.shutdown()

    # -- statistics ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters for metrics and benches; the queue and KV figures are the scheduler's."""
        return engine_stats(self.scheduler, self.counters, self.max_model_len,
                            self.structured.stats())

    # -- chat ------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict],
                    chat_template_kwargs: Optional[Mapping[str, Any]] = None,
                    tools: Optional[list[dict]] = None) -> str:
        """The checkpoint's chat template applied, with the generation prompt.
        ``chat_template_kwargs`` are variables the template reads (Qwen3's
        ``enable_thinking``), as vLLM and its OpenAI server take them; ``tools`` are OpenAI's
        function tools, refused when the template does not render them."""
        return render_chat(self.tokenizer, messages, chat_template_kwargs, tools,
                           self.tool_call_format if tools else NO_TOOLS)

    @property
    def tool_call_format(self) -> str:
        """What the chat template does with tools (``engine.prompts.tool_call_format``),
        found once; the worker advertises it in its heartbeat."""
        if self._tool_format is None:
            self._tool_format = tool_call_format(self.tokenizer)
        return self._tool_format
