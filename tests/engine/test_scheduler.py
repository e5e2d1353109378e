"""Scheduler: token budget, decodes before prefills, chunking, preemption, priority, abort.

The model is simulated: a step "computes" the scheduled tokens and appends token 7 to every
sequence that reached its end, which is all the scheduler can observe of a real model.
"""

from __future__ import annotations

import itertools

from tokenrelay.engine.block_manager import BlockManager
from tokenrelay.engine.sampling_params import SamplingParams
from tokenrelay.engine.scheduler import Scheduler, SchedulerOutput
from tokenrelay.engine.sequence import Sequence, SequenceStatus

_arrivals = itertools.count()


def make_seq(rid: str, prompt_len: int, max_tokens: int = 8, priority: int = 0,
             first_token: int = 0) -> Sequence:
    tokens = [first_token + i for i in range(prompt_len)]
    return Sequence(rid, tokens, SamplingParams(max_tokens=max_tokens), priority=priority,
                    arrival_index=next(_arrivals), seed=0)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8,
                   budget: int = 64, prefix: bool = True) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, prefix)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)


def sim_step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out)
    for s in out.seqs:
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)
            if s.num_output_tokens >= s.params.max_tokens:
                sched.finish(s, "length")
    return out


def test_budget_and_chunked_prefill():
    sched = make_scheduler(budget=16)
    long = make_seq("long", 40)
    sched.add(long)
    out = sim_step(sched)
    assert out.num_new_tokens == [16] and long.num_computed_tokens == 16
    assert long.status is SequenceStatus.RUNNING and long.num_output_tokens == 0
    sim_step(sched)
    out = sim_step(sched)
    assert out.num_new_tokens == [8] and long.num_output_tokens == 1


def test_decodes_are_scheduled_before_a_long_prompt_chunk():
    sched = make_scheduler(budget=10)
    a, b = make_seq("a", 3, max_tokens=50), make_seq("b", 3, max_tokens=50)
    sched.add(a)
    sched.add(b)
    sim_step(sched)                    # both prefilled, one token each
    long = make_seq("long", 100)
    sched.add(long)
    for _ in range(5):
        out = sim_step(sched)
        assert out.seqs[:2] == [a, b] and out.num_new_tokens[:2] == [1, 1]
        assert out.num_batched_tokens <= 10
    assert long.num_computed_tokens == 5 * 8


def test_priority_then_arrival_order_for_admission():
    sched = make_scheduler(max_num_seqs=1)
    low = make_seq("low", 4, priority=5)
    high = make_seq("high", 4, priority=-1)
    mid = make_seq("mid", 4, priority=0)
    mid2 = make_seq("mid2", 4, priority=0)
    for s in (low, mid, high, mid2):
        sched.add(s)
    assert [s.request_id for s in sched.waiting] == ["high", "mid", "mid2", "low"]
    out = sim_step(sched)
    assert out.seqs == [high]


def test_max_num_seqs_caps_running():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add(make_seq(f"r{i}", 4))
    sim_step(sched)
    assert len(sched.running) == 2 and len(sched.waiting) == 2


def test_preemption_picks_lowest_priority_latest_arrival_and_recovers():
    # 6 blocks of 4 tokens: three 7-token prompts take 2 blocks each; decoding needs more.
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, prefix=False)
    sched.watermark_blocks = 0
    a = make_seq("a", 7, max_tokens=6, priority=0)
    b = make_seq("b", 7, max_tokens=6, priority=1, first_token=100)
    c = make_seq("c", 7, max_tokens=6, priority=0, first_token=200)
    for s in (a, b, c):
        sched.add(s)
    sim_step(sched)
    assert sched.block_manager.num_free_blocks == 0
    sim_step(sched)
    out = sim_step(sched)              # a and c need a 3rd block: b (priority 1) is the victim
    assert out.preempted[0] is b and b.status is SequenceStatus.WAITING and b.block_table == []
    assert sched.num_preemptions >= 1
    for _ in range(200):
        if not sched.has_unfinished():
            break
        sim_step(sched)
    assert not sched.has_unfinished()
    for s in (a, b, c):
        assert s.num_output_tokens == 6
    assert sched.block_manager.num_free_blocks == 6


def test_lone_sequence_preempts_itself_then_resumes():
    sched = make_scheduler(num_blocks=3, block_size=4, prefix=False)
    sched.watermark_blocks = 0
    s = make_seq("s", 5, max_tokens=7)   # needs 3 blocks over its life: fits alone
    sched.add(s)
    for _ in range(50):
        if not sched.has_unfinished():
            break
        sim_step(sched)
    assert s.num_output_tokens == 7 and sched.block_manager.num_free_blocks == 3


def test_finish_in_any_state_frees_blocks_at_once():
    sched = make_scheduler(budget=8)
    a = make_seq("a", 20)
    b = make_seq("b", 4)
    sched.add(a)
    sched.add(b)
    sim_step(sched)                    # a partially prefilled, b waiting
    assert a.status is SequenceStatus.RUNNING and a.block_table
    sched.finish(a, "abort")
    sched.finish(b, "abort")
    assert sched.block_manager.num_free_blocks == 64
    assert not sched.has_unfinished()


def test_prefix_cache_hit_skips_computing_shared_tokens():
    sched = make_scheduler(budget=64)
    a = make_seq("a", 12)
    sched.add(a)
    sim_step(sched)
    b = make_seq("b", 14)              # same first 12 tokens
    sched.add(b)
    out = sim_step(sched)
    assert out.num_new_tokens[out.seqs.index(b)] == 14 - 12
    assert sched.block_manager.num_hit_tokens == 12


def test_high_priority_arrival_preempts_lower_priority_running():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=8, prefix=False)
    sched.watermark_blocks = 0
    low = make_seq("low", 12, max_tokens=4, priority=3)       # 3 of the 4 blocks
    sched.add(low)
    sim_step(sched)
    urgent = make_seq("urgent", 8, max_tokens=2, priority=0, first_token=50)
    sched.add(urgent)
    out = sim_step(sched)
    assert low in out.preempted and urgent in out.seqs and low not in out.seqs
    same = make_seq("same", 8, max_tokens=2, priority=0, first_token=90)
    sched.add(same)
    out = sim_step(sched)                   # equal priority never preempts
    assert not out.preempted and same not in out.seqs
    for _ in range(50):
        if not sched.has_unfinished():
            break
        sim_step(sched)
    assert low.num_output_tokens == 4 and sched.block_manager.num_free_blocks == 4


def test_free_capacity_is_slots_bounded_by_blocks_after_waiting_prompts():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64)
    # Before any request: the typical request (512 tokens = 128 blocks) does not fit 64
    # blocks, but an idle engine still offers one place (else its worker would never read a
    # job: a config with a small pool and a long max_model_len hung idle).
    assert sched.free_capacity() == 1
    sched = make_scheduler(num_blocks=24, block_size=4, max_num_seqs=8, budget=64)
    sched.add(make_seq("big", 60, max_tokens=30))       # 90 tokens: 23 blocks a request
    assert sched.free_capacity() == 0                   # not idle: the requests' size rules
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64,
                      typical_request_tokens=16)
    assert sched.free_capacity() == 8                   # 64 free / 4 each = 16, 8 slots
    sched.add(make_seq("a", 20, max_tokens=12))         # 32 tokens = 8 blocks a request
    # 7 slots left; 64 free - 5 for the waiting prompt = 59 blocks / 8 = 7.
    assert sched.free_capacity() == 7
    sched.add(make_seq("b", 20, max_tokens=12))
    sched.add(make_seq("c", 20, max_tokens=12))
    assert sched.free_capacity() == min(5, (64 - 15) // 8)


def test_stats_count_a_shared_prefix_block_once_in_kv_utilization():
    sched = make_scheduler(num_blocks=64, block_size=4, budget=64)
    sched.add(make_seq("a", 9, max_tokens=4))
    sim_step(sched)                                     # a: 9 tokens, 3 blocks, 2 full
    sched.add(make_seq("b", 9, max_tokens=4))           # the same prompt: 2 blocks shared
    sim_step(sched)
    s = sched.stats()
    assert (s.num_running, s.num_waiting, s.num_running_peak) == (2, 0, 2)
    assert s.kv.blocks_used == 4 and s.kv_blocks_peak == 4
    assert s.kv.prefix_cache_hit_tokens == 8
    # Stored: a's 10 tokens + b's 9, less the 8 slots b shares with a = 11 tokens in 16 slots.
    assert s.kv_utilization_peak == 11 / 16
