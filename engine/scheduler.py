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

Requests with several choices are a ``SequenceGroup``: preemption takes a whole group (its
choices share blocks; recomputing one alone would break the sharing), and a group counts its
``width`` against ``max_num_seqs`` from admission on, so its fork always has room. A beam group
moves in lockstep: its beams decode in the same step or not at all, and a beam being recomputed
stops one token short, so no beam reaches the sampler before its siblings.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Optional

from tokenrelay.engine.block_manager import BlockManager, KVCacheStats
from tokenrelay.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """What to compute this step: ``num_new_tokens[i]`` tokens of ``seqs[i]``."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)   # copy on write (src, dst)

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

    def add_fork(self, child: Sequence) -> None:
        """A choice forked from a running sequence runs at once (its blocks are shared)."""
        child.status = SequenceStatus.RUNNING
        bisect.insort(self.running, child, key=Sequence.sort_key)

    def finish(self, seq: Sequence, reason: Optional[str] = None) -> None:
        """Remove a sequence from whichever queue holds it and its group, free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        if seq in seq.group.seqs:
            seq.group.seqs.remove(seq)
        if reason is not None:
            seq.finish_reason = reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _slots_used(self) -> int:
        return sum(1 if s.group.forked else s.group.width for s in self.running)

    def free_capacity(self) -> int:
        """How many more requests could start soon: free sequence slots, bounded by the free
        KV blocks left after the waiting prompts, divided by the average request's blocks."""
        bm = self.block_manager
        slots = self.max_num_seqs - self._slots_used() - len(self.waiting)
        pending = sum(bm.blocks_for(s.num_tokens) for s in self.waiting)
        headroom = bm.num_free_blocks - pending
        if self._request_count:
            per_request = max(1, self._request_blocks_sum // self._request_count)
        else:
            per_request = bm.blocks_for(self.typical_request_tokens)
        fit = headroom // per_request
        if fit < 1 and slots > 0 and not self.running and not self.waiting:
            # An idle engine always takes one: a pool smaller than the typical request
            # (``min(max_model_len, 512)`` tokens) would otherwise never be offered any, and
            # one that cannot fit is refused at add time with the numbers.
            fit = 1
        return max(0, min(slots, fit))

    def _preempt(self, seq: Sequence) -> list[Sequence]:
        """Send ``seq``'s whole group back to waiting; returns the sequences preempted."""
        members = [s for s in seq.group.seqs if s.status is SequenceStatus.RUNNING]
        for s in members:
            self.running.remove(s)
            self.block_manager.free(s)
            s.num_computed_tokens = 0
            s.status = SequenceStatus.WAITING
            bisect.insort(self.waiting, s, key=Sequence.sort_key)
        self.num_preemptions += 1
        return members

    def _preempt_last(self, scheduled: dict[Sequence, int], preempted: list[Sequence]) -> int:
        """Preempt the lowest-priority running group; returns the budget it gave back."""
        freed = 0
        for v in self._preempt(self.running[-1]):
            preempted.append(v)
            freed += scheduled.pop(v, 0)
        return freed

    def _needed(self, seqs: list[Sequence], n: int) -> int:
        return sum(self.block_manager.num_blocks_needed(s, n) for s in seqs)

    @staticmethod
    def _chunk(seq: Sequence, budget: int) -> int:
        """Tokens to compute for a sequence still prefilling: a beam being recomputed beside
        siblings stops one short (its last token decodes with theirs)."""
        hold = 1 if seq.group.lockstep else 0
        return min(seq.num_uncomputed_tokens - hold, budget)

    # -- the step --------------------------------------------------------------------------
    def schedule(self, hold: frozenset[Sequence] = frozenset()) -> SchedulerOutput:
        """The step's sequences and token counts. ``hold``: running sequences that get no
        tokens this step (the overlapped core's choices that will certainly end with the token
        in flight, engine/overlap.py); they keep their blocks until that token is processed."""
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        scheduled: dict[Sequence, int] = {}
        preempted: list[Sequence] = []

        live = [s for s in self.running if s not in hold] if hold else self.running
        decodes: list[Sequence] = []
        chunks: list[Sequence] = []
        for s in live:
            left = len(s.token_ids) - s.num_computed_tokens
            if left == 1:
                decodes.append(s)
            elif left > 1:
                chunks.append(s)
        num_decodes = len(decodes)
        done_groups: set[int] = set()
        for k, seq in enumerate(decodes + chunks):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if k < num_decodes and seq.group.beam is None and bm.decode_fits(seq):
                # The steady state in one test: a decode whose next slot it holds alone takes
                # one token and allocates nothing, what the general path below decides for
                # it, without its calls (this runs for every sequence, every step).
                scheduled[seq] = 1
                budget -= 1
                continue
            if seq.group.lockstep and seq.num_uncomputed_tokens == 1:
                if id(seq.group) not in done_groups:
                    done_groups.add(id(seq.group))
                    budget = self._schedule_lockstep(seq.group, budget, scheduled, preempted)
                continue
            n = self._chunk(seq, budget)
            if n <= 0:
                continue
            need = bm.num_blocks_needed(seq, n)
            while need > bm.num_free_blocks:
                budget += self._preempt_last(scheduled, preempted)
                if seq.status is not SequenceStatus.RUNNING:
                    break
                need = bm.num_blocks_needed(seq, n)     # a sibling's preemption may unshare
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if need:        # most decodes: the last block has room, nothing to allocate
                bm.allocate(seq, n)
            scheduled[seq] = n
            budget -= n

        decode_pressure = bool(preempted)
        while not decode_pressure and self.waiting and budget > 0:
            seq = self.waiting[0]
            members = [s for s in self.waiting if s.group is seq.group]
            slots = len(members) if seq.group.forked else seq.group.width
            used = None
            if self._slots_used() + slots <= self.max_num_seqs:
                used = self._admit_group(members, budget, scheduled)
            if used is None:
                # No room. A strictly lower-priority running sequence yields its place.
                victim = self.running[-1] if self.running else None
                if victim is None or victim.priority <= seq.priority:
                    break
                budget += self._preempt_last(scheduled, preempted)
                continue
            budget -= used

        return SchedulerOutput(list(scheduled), list(scheduled.values()), preempted,
                               bm.take_copies())

    def _schedule_lockstep(self, group, budget: int, scheduled: dict[Sequence, int],
                           preempted: list[Sequence]) -> int:
        """Decode every beam of ``group`` this step, or none; returns the budget left."""
        members = list(group.seqs)
        ready = all(s.status is SequenceStatus.RUNNING and s.num_uncomputed_tokens == 1
                    for s in members)
        if not ready or budget < len(members):
            return budget
        bm = self.block_manager
        while self._needed(members, 1) > bm.num_free_blocks:
            budget += self._preempt_last(scheduled, preempted)
            if members[0].status is not SequenceStatus.RUNNING:
                return budget
        for s in members:
            bm.allocate(s, 1)
            scheduled[s] = 1
        return budget - len(members)

    def _admit_group(self, members: list[Sequence], budget: int,
                     scheduled: dict[Sequence, int]) -> Optional[int]:
        """Admit a group's waiting sequences together, or none of them (None).

        A choice being recomputed shares the leading blocks a sibling admitted before it in
        this step computes (the step stores every token's K/V before any attention reads), so
        a preempted group regains its sharing instead of needing one full copy per choice.
        Returns the tokens scheduled."""
        bm = self.block_manager
        group = members[0].group
        others = any(s.group is not group for s in self.running)
        # The watermark keeps room for other requests' decodes; a group waiting only on
        # itself must not be kept out by it.
        reserve = self.watermark_blocks if others else 0
        hold = 1 if group.lockstep else 0
        done: list[tuple[Sequence, list[int]]] = []
        used = 0
        for s in members:
            cached = bm.match_prefix(s)
            shared = self._sibling_blocks(s, [d for d, _ in done], scheduled)
            blocks = shared if len(shared) > len(cached) else cached
            n = max(0, min(s.num_tokens - len(blocks) * bm.block_size - hold, budget - used))
            if bm.num_blocks_needed(s, n, blocks) + reserve > bm.num_free_blocks:
                self._undo_admission([d for d, _ in done], scheduled)
                return None
            self._admit(s, blocks, n, scheduled)
            done.append((s, cached if blocks is cached else []))
            used += n
        for s, cached in done:
            bm.record_query(s.num_tokens, len(cached) * bm.block_size)
        return used

    def _sibling_blocks(self, seq: Sequence, siblings: list[Sequence],
                        scheduled: dict[Sequence, int]) -> list[int]:
        """The longest run of leading blocks an admitted sibling fills by the end of this step
        with exactly ``seq``'s tokens (at most ``num_tokens - 1`` tokens, as match_prefix)."""
        bs = self.block_manager.block_size
        best: list[int] = []
        limit = (seq.num_tokens - 1) // bs
        for sib in siblings:
            filled = (sib.num_computed_tokens + scheduled.get(sib, 0)) // bs
            i = 0
            while (i < min(limit, filled)
                   and sib.token_ids[i * bs:(i + 1) * bs] == seq.token_ids[i * bs:(i + 1) * bs]):
                i += 1
            if i > len(best):
                best = sib.block_table[:i]
        return best

    def _undo_admission(self, seqs: list[Sequence], scheduled: dict[Sequence, int]) -> None:
        for s in seqs:
            self.running.remove(s)
            self.block_manager.free(s)
            s.num_computed_tokens = 0
            s.status = SequenceStatus.WAITING
            scheduled.pop(s, None)
            bisect.insort(self.waiting, s, key=Sequence.sort_key)

    def _admit(self, seq: Sequence, cached: list[int], n: int,
               scheduled: dict[Sequence, int]) -> None:
        bm = self.block_manager
        self.waiting.remove(seq)
        bm.allocate(seq, n, cached)
        seq.num_computed_tokens = len(cached) * bm.block_size
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=Sequence.sort_key)
        if n:
            scheduled[seq] = n

    def update(self, out: SchedulerOutput) -> None:
        """After the model ran (or, overlapped, once the step's inputs are all known tokens):
        the scheduled tokens now have KV; publish full blocks. A sequence that ended in the
        meantime is skipped: its blocks are already freed."""
        bm = self.block_manager
        bs, caching = bm.block_size, bm.enable_prefix_caching
        for seq, n in zip(out.seqs, out.num_new_tokens):
            if seq.status is SequenceStatus.FINISHED:
                continue
            seq.num_computed_tokens += n
            if caching and seq.num_computed_tokens // bs > seq.num_cached_blocks:
                bm.cache_full_blocks(seq)       # a block filled up (most steps: none)
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
        stored = (sum(s.num_computed_tokens for s in self.running)
                  - bm.num_shared_token_copies(self.running))
        self._kv_utilization_peak = stored / (used * bm.block_size)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            num_running_peak=self._num_running_peak, num_preemptions=self.num_preemptions,
            kv_blocks_peak=self._kv_blocks_peak, kv_utilization_peak=self._kv_utilization_peak,
            kv=self.block_manager.stats())
