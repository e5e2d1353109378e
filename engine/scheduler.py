"""Scheduler: continuous batching under one token budget per step.

Each step (the vLLM v1 scheme):

1. Running sequences get tokens first: decodes (one token each) before the remaining chunks
   of partially prefilled prompts, so a long prompt never stalls the decodes.
2. Waiting sequences (by priority, then arrival) are admitted while the budget
   (``max_num_batched_tokens``), ``max_num_seqs`` and free KV blocks allow. A prompt larger
   than what is left of the budget is chunked: it gets what is left and continues next step.
3. When a running sequence needs a block and none is free, the lowest-priority running
   sequence (highest priority number, then latest arrival) is preempted: its blocks are freed
   and it goes back to waiting, to be recomputed later (its prefix is often still cached).
   No new sequence is admitted in a step whose decodes had to preempt, to avoid thrashing.
4. A waiting sequence that does not fit may preempt running ones of strictly lower priority
   (a larger priority number), so priority holds under load too.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional

from engine.block_manager import BlockManager, KVCacheStats
from engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """What to compute this step: ``num_new_tokens[i]`` tokens of ``seqs[i]``."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)


@dataclass(frozen=True)
class SchedulerStats:
    """Queues now, peaks since start, and the KV pool (the engine publishes these)."""

    num_running: int
    num_waiting: int
    num_running_peak: int
    num_preemptions: int
    kv_blocks_peak: int                 # most blocks in use after any step
    kv_utilization_peak: float          # tokens stored / slots allocated, at that step
    kv: KVCacheStats


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, typical_request_tokens: int = 512) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # The request size free_capacity() assumes until requests have arrived.
        self.typical_request_tokens = typical_request_tokens
        # Keep a few blocks free when admitting new prompts, so running decodes do not need
        # to preempt the prompt we just spent a step prefilling.
        self.watermark_blocks = max(1, block_manager.num_blocks // 100)
        self.waiting: list[Sequence] = []   # sorted by Sequence.sort_key
        self.running: list[Sequence] = []   # sorted by Sequence.sort_key
        self.num_preemptions = 0
        # Statistics: requests' full sizes (prompt + max_tokens) in blocks, and peaks.
        self._request_blocks_sum = 0
        self._request_count = 0
        self._num_running_peak = 0
        self._kv_blocks_peak = 0
        self._kv_utilization_peak = 0.0

    # -- queue management ------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)
        self._request_blocks_sum += self.block_manager.blocks_for(
            seq.num_prompt_tokens + seq.params.max_tokens)
        self._request_count += 1

    def finish(self, seq: Sequence, reason: Optional[str] = None) -> None:
        """Remove a sequence from whichever queue holds it and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        if reason is not None:
            seq.finish_reason = reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def free_capacity(self) -> int:
        """How many more requests could start soon: free sequence slots, bounded by the free
        KV blocks left after the waiting prompts, divided by the average request's blocks."""
        bm = self.block_manager
        slots = self.max_num_seqs - self.num_unfinished()
        pending = sum(bm.blocks_for(s.num_tokens) for s in self.waiting)
        headroom = bm.num_free_blocks - pending
        if self._request_count:
            per_request = max(1, self._request_blocks_sum // self._request_count)
        else:
            per_request = bm.blocks_for(self.typical_request_tokens)
        return max(0, min(slots, headroom // per_request))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=Sequence.sort_key)
        self.num_preemptions += 1

    # -- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        scheduled: dict[Sequence, int] = {}
        preempted: list[Sequence] = []

        decodes = [s for s in self.running if s.num_uncomputed_tokens == 1]
        chunks = [s for s in self.running if s.num_uncomputed_tokens > 1]
        for seq in decodes + chunks:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_uncomputed_tokens, budget)
            while not bm.can_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim in scheduled:
                    budget += scheduled.pop(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            bm.allocate(seq, n)
            scheduled[seq] = n
            budget -= n

        decode_pressure = bool(preempted)
        while not decode_pressure and self.waiting and budget > 0:
            seq = self.waiting[0]
            cached = bm.match_prefix(seq)
            num_cached_tokens = len(cached) * bm.block_size
            n = min(seq.num_tokens - num_cached_tokens, budget)
            reserve = self.watermark_blocks if self.running else 0
            if (len(self.running) >= self.max_num_seqs
                    or bm.num_blocks_needed(seq, n, cached) + reserve > bm.num_free_blocks):
                # No room. A strictly lower-priority running sequence yields its place.
                victim = self.running[-1] if self.running else None
                if victim is None or victim.priority <= seq.priority:
                    break
                self._preempt(victim)
                preempted.append(victim)
                if victim in scheduled:
                    budget += scheduled.pop(victim)
                continue
            self.waiting.pop(0)
            bm.allocate(seq, n, cached)
            bm.record_query(seq.num_tokens, num_cached_tokens)
            seq.num_computed_tokens = num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=Sequence.sort_key)
            scheduled[seq] = n
            budget -= n

        return SchedulerOutput(list(scheduled), list(scheduled.values()), preempted)

    def update(self, out: SchedulerOutput) -> None:
        """After the model ran: the scheduled tokens now have KV; publish full blocks."""
        bm = self.block_manager
        for seq, n in zip(out.seqs, out.num_new_tokens):
            seq.num_computed_tokens += n
            bm.cache_full_blocks(seq)
        self._record_peaks()

    # -- statistics ------------------------------------------------------------------------
    def _record_peaks(self) -> None:
        """Most sequences running, and, at the step with the most blocks in use, the share of
        allocated slots that hold tokens (each shared prefix block counted once)."""
        bm = self.block_manager
        self._num_running_peak = max(self._num_running_peak, len(self.running))
        used = bm.num_used_blocks
        if used <= self._kv_blocks_peak:
            return
        self._kv_blocks_peak = used
        stored = sum(s.num_computed_tokens for s in self.running) - bm.num_shared_token_copies()
        self._kv_utilization_peak = stored / (used * bm.block_size)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            num_running_peak=self._num_running_peak, num_preemptions=self.num_preemptions,
            kv_blocks_peak=self._kv_blocks_peak, kv_utilization_peak=self._kv_utilization_peak,
            kv=self.block_manager.stats())
