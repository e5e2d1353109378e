"""EngineCore: schedule, run, sample; token ids in, token ids out (vLLM v1's engine core).

One ``step()`` = admit requests whose grammar is ready -> schedule -> one forward pass ->
mask and sample -> the finish rules that need no text (engine/finish_rules.py). It knows no
tokenizer output, no text and no stop strings: those are the output processor's
(engine/output_processor.py), which tells the core when a stop string ended a choice
(``finish_choice``). So the core can run in a process of its own beside a GPU
(engine/core_process.py) while the caller's process turns its ids into text and events.

With ``async_scheduling`` the steps overlap (engine/overlap.py); grammars, beams, penalties and
prompts about to fork step serially. The core's only threads are the grammar compiler's and,
overlapped on CPU, the simulated device lane.
"""

from __future__ import annotations

import itertools
import random
import time
from typing import Any, Callable, Optional

import torch

from tokenrelay.engine.beam_search import BeamSearch
from tokenrelay.engine.block_manager import BlockManager
from tokenrelay.engine.block_tables import BlockTables
from tokenrelay.engine.config import EngineConfig
from tokenrelay.engine.finish_rules import FinishRules, finish_choice
from tokenrelay.engine.forks import beam_step, branch_seed, fork_samples
from tokenrelay.engine.grammar import GrammarError
from tokenrelay.engine.model_runner import ModelRunner
from tokenrelay.engine.outputs import CoreOutput, CoreRequest, RequestError, StepCounters
from tokenrelay.engine.overlap import PLACEHOLDER, OverlappedCore
from tokenrelay.engine.sampler import Sampler
from tokenrelay.engine.scheduler import Scheduler
from tokenrelay.engine.sequence import Sequence, SequenceGroup, SequenceStatus
from tokenrelay.engine.structured import StructuredOutputs


def eos_ids(config: EngineConfig, tokenizer: Any) -> set[int]:
    """EOS ids: config.json's and generation_config.json's ``eos_token_id`` (int or list, read
    by ModelConfig) plus the tokenizer's."""
    ids = set(config.hf_config.eos_token_ids)
    tok_eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(tok_eos, int):
        ids.add(tok_eos)
    return ids


def engine_stats(scheduler: Scheduler, counters: StepCounters, max_model_len: int,
                 structured: dict[str, Any]) -> dict[str, Any]:
    """The flat statistics the engine publishes (``LLMEngine.stats``)."""
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


def error_output(request_id: str, exc: Exception, num_prompt_tokens: int = 0) -> CoreOutput:
    """The one, last output of a request the core ended with an error."""
    return CoreOutput(request_id, 0, [], [], None, None, None, num_prompt_tokens, 0, None,
                      ends_request=True,
                      error=RequestError(getattr(exc, "code", "invalid_request"), str(exc)))


class EngineCore:
    """Continuous batching over a paged KV cache, in token ids.

    ``tokenizer`` is used only by structured outputs (a grammar's vocabulary) and for its EOS
    id. ``on_parallel_failure(message)`` is called once if a rank of a tensor-parallel engine
    dies or a collective fails (after which every step raises ``TensorParallelError``).
    """

    def __init__(self, config: EngineConfig, *, tokenizer: Any, model: Optional[Any] = None,
                 on_parallel_failure: Optional[Callable[[str], None]] = None) -> None:
        self.config = config.resolve()
        tables = BlockTables()
        self.model_runner = ModelRunner(config, model, on_parallel_failure=on_parallel_failure,
                                        tables=tables)
        self.vocab_size = config.hf_config.vocab_size
        self.max_model_len: int = config.max_model_len  # type: ignore[assignment]
        self.block_manager = BlockManager(self.model_runner.num_blocks, config.block_size,
                                          config.enable_prefix_caching, tables=tables)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   typical_request_tokens=min(self.max_model_len, 512))
        self.eos_token_ids = eos_ids(config, tokenizer)
        self.sampler = Sampler(self.vocab_size, sorted(self.eos_token_ids))
        self.structured = StructuredOutputs(tokenizer, self.vocab_size, self.eos_token_ids,
                                            threads=config.grammar_compile_threads,
                                            timeout_s=config.grammar_compile_timeout_s)
        self.rules = FinishRules(self.scheduler, self.eos_token_ids, self.max_model_len)
        self.counters = StepCounters()
        self.overlap: Optional[OverlappedCore] = None
        if self.config.async_scheduling:
            self.overlap = OverlappedCore(scheduler=self.scheduler, runner=self.model_runner,
                                          sampler=self.sampler, rules=self.rules,
                                          counters=self.counters,
                                          max_model_len=self.max_model_len)
        self.requests: dict[str, SequenceGroup] = {}
        self._seed_rng = random.Random(config.seed)
        self._arrivals = itertools.count()

    # -- requests --------------------------------------------------------------------------
    def add(self, req: CoreRequest) -> None:
        """Queue a checked request (the front end ran engine/request_checks.py). A request
        with ``structured_outputs`` waits outside the scheduler until its grammar is compiled
        (engine/structured.py); a spec known to fail raises GrammarError here, changing
        nothing."""
        params = req.params
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        beam = None
        if params.use_beam_search:
            beam = BeamSearch(params.num_choices, length_penalty=params.length_penalty,
                              eos_token_ids=sorted(self.eos_token_ids),
                              ignore_eos=params.ignore_eos, max_tokens=params.max_tokens,
                              min_tokens=params.min_tokens)
        group = SequenceGroup(req.request_id, params.num_choices, params=params, seed=seed,
                              beam=beam)
        arrival = next(self._arrivals)
        states = req.resume
        runs = [(0, None)] if states is None else [
            (i, st) for i, st in enumerate(states) if st.finish_reason is None]
        group.forked = group.forked or states is not None
        seqs = []
        for index, state in runs:
            seq = Sequence(req.request_id, req.prompt_token_ids, params, priority=req.priority,
                           arrival_index=arrival, seed=branch_seed(seed, index), index=index,
                           group=group)
            if state is not None and state.output_token_ids:
                seq.token_ids.extend(state.output_token_ids)
            seqs.append(seq)
        if params.structured_outputs is not None:
            self.structured.add(req.request_id, params.structured_outputs, seqs,
                                owner=req.owner)
        self.requests[req.request_id] = group
        if params.structured_outputs is None:
            for seq in seqs:
                self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request in any state and free its blocks at once. Silent: no output follows."""
        group = self.requests.pop(request_id, None)
        if group is None:
            return False
        self._drop(group, scheduled=not self.structured.abort(request_id))
        return True

    def finish_choice(self, request_id: str, index: int, stop_reason: Any) -> None:
        """A stop string ended choice ``index`` (the output processor found it): free it now.
        Tokens it drew since are dropped; a placeholder in flight is cut off."""
        group = self.requests.get(request_id)
        if group is None:
            return
        seq = next((s for s in group.seqs if s.index == index), None)
        if seq is None:
            return
        while seq.token_ids and seq.token_ids[-1] == PLACEHOLDER:
            seq.token_ids.pop()
        if finish_choice(self.scheduler, seq, "stop", stop_reason, time.time()):
            del self.requests[request_id]

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

    def _fail(self, request_id: str, exc: Exception, scheduled: bool = True) -> CoreOutput:
        """End a request the core accepted with an error: its one, last output."""
        group = self.requests.pop(request_id, None)
        seqs = list(group.seqs) + list(group.finished.values()) if group is not None else []
        if group is not None:
            self._drop(group, scheduled)
        return error_output(request_id, exc, seqs[0].num_prompt_tokens if seqs else 0)

    def request_seed(self, request_id: str) -> int:
        """The sampling seed of a live request (drawn at add time when it gave none)."""
        group = self.requests.get(request_id)
        if group is None:
            raise KeyError(f"no unfinished request {request_id!r}")
        return group.seed

    def has_unfinished(self) -> bool:
        return (self.scheduler.has_unfinished() or bool(self.structured.waiting)
                or (self.overlap is not None and self.overlap.flight is not None))

    def free_capacity(self) -> int:
        """How many more requests could start soon (see Scheduler.free_capacity)."""
        return max(0, self.scheduler.free_capacity() - len(self.structured.waiting))

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[CoreOutput]:
        """Run one scheduling step: at most one output per choice that got a token, one per
        finished beam, and the error output of each request the core ended."""
        outs = self._admit_constrained()
        if self.overlap is not None:
            if self.overlap.eligible():
                return outs + self._take(*self.overlap.step())
            outs.extend(self._take(*self.overlap.drain()))
        if not self.scheduler.has_unfinished():
            return outs
        out = self.scheduler.schedule()
        if out.is_empty:
            return outs
        logits, rows = self.model_runner.execute(out.seqs, out.num_new_tokens, out.block_copies)
        self.scheduler.update(out)
        self.counters.num_steps += 1
        self.counters.num_computed_tokens += out.num_batched_tokens
        if not rows:
            return outs
        sample_seqs: list[Sequence] = []
        sample_rows: list[int] = []
        beam_rows: dict[int, tuple[SequenceGroup, dict[int, int]]] = {}
        for row, i in enumerate(rows):
            seq = out.seqs[i]
            group = seq.group
            if group.beam is not None:
                beam_rows.setdefault(id(group), (group, {}))[1][id(seq)] = row
                continue
            branches = [seq] if group.forked else fork_samples(seq, self.scheduler)
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
            outs.extend(self._take(*self.rules.process(sample_seqs, sampled, failed,
                                                       time.time())))
            outs.extend(self._fail(rid, exc) for rid, exc in failed.items())
        for group, by_seq in beam_rows.values():
            outs.extend(self._beam_step(group, by_seq, logits))
        return outs

    def _take(self, done: list[CoreOutput], ended: list[str]) -> list[CoreOutput]:
        """Account for processed outputs; forget the requests whose last choice ended."""
        for request_id in ended:
            del self.requests[request_id]
        self.counters.num_generated_tokens += len(done)
        return done

    def _admit_constrained(self) -> list[CoreOutput]:
        """Constrained requests whose matchers are ready go to the scheduler; those whose
        grammar failed or timed out end here. Waits briefly when nothing else could run."""
        if not self.structured.waiting:
            return []
        polled = self.structured.poll(block=not self.scheduler.has_unfinished())
        for seq in polled.ready:
            self.scheduler.add(seq)
        return [self._fail(rid, exc, scheduled=False) for rid, exc in polled.failed]

    def _beam_step(self, group: SequenceGroup, rows: dict[int, int],
                   logits: torch.Tensor) -> list[CoreOutput]:
        """One beam step (engine/forks.py); a matcher that failed ends the request."""
        step = beam_step(group, [rows[id(s)] for s in group.seqs], logits,
                         structured=self.structured, scheduler=self.scheduler,
                         max_model_len=self.max_model_len)
        if isinstance(step, GrammarError):
            return [self._fail(group.request_id, step)]
        if step:                            # the search ended: every beam, best first
            del self.requests[group.request_id]
            self.counters.num_generated_tokens += sum(len(o.new_token_ids) for o in step)
        return step

    def shutdown(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (also done when it is garbage
        collected or the process exits); nothing to do at size 1. Stops the overlapped core's
        device thread (CPU) after its step in flight."""
        if self.overlap is not None:
            self.overlap.shutdown()
        self.model_runner.shutdown()

    def stats(self) -> dict[str, Any]:
        """Counters for metrics and benches; the queue and KV figures are the scheduler's."""
        return engine_stats(self.scheduler, self.counters, self.max_model_len,
                            self.structured.stats())
