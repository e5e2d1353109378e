"""BlockManager: allocation, ref counts, chained-hash prefix caching, LRU eviction."""

from __future__ import annotations

import itertools

import pytest

from tokenrelay.engine.block_manager import BlockManager, NoFreeBlocksError
from tokenrelay.engine.sampling_params import SamplingParams
from tokenrelay.engine.sequence import Sequence

_ids = itertools.count()


def seq(tokens: list[int]) -> Sequence:
    return Sequence(f"r{next(_ids)}", tokens, SamplingParams(), priority=0,
                    arrival_index=next(_ids), seed=0)


def run_prefill(bm: BlockManager, s: Sequence) -> None:
    """Admit like the scheduler does: match the prefix, allocate the rest, mark computed."""
    cached = bm.match_prefix(s)
    s_cached = len(cached) * bm.block_size
    bm.allocate(s, s.num_tokens - s_cached, cached)
    bm.record_query(s.num_tokens, s_cached)
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    s = seq(list(range(10)))
    bm.allocate(s, 10)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    assert all(bm.ref_counts[b] == 1 for b in s.block_table)
    bm.free(s)
    assert bm.num_free_blocks == 8 and s.block_table == []
    assert all(rc == 0 for rc in bm.ref_counts)


def test_allocate_grows_block_table_only_when_a_block_fills():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(list(range(4)))
    bm.allocate(s, 4)
    s.num_computed_tokens = 4
    s.token_ids.append(99)
    assert bm.num_blocks_needed(s, 1) == 1
    bm.allocate(s, 1)
    s.num_computed_tokens = 5
    assert len(s.block_table) == 2
    s.token_ids.append(98)
    assert bm.num_blocks_needed(s, 1) == 0


def test_allocate_without_room_raises_and_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(list(range(12)))
    assert not bm.can_allocate(s, 12)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(s, 12)
    assert bm.num_free_blocks == 2 and s.block_table == []


def test_prefix_hit_shares_full_blocks_and_counts_refs():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(list(range(10)))
    run_prefill(bm, a)
    b = seq(list(range(8)) + [50, 51, 52])
    assert bm.match_prefix(b) == a.block_table[:2]
    run_prefill(bm, b)
    assert b.block_table[:2] == a.block_table[:2]
    assert b.block_table[2] != a.block_table[2]
    assert [bm.ref_counts[x] for x in a.block_table[:2]] == [2, 2]
    assert bm.num_hit_tokens == 8
    bm.free(a)
    bm.free(b)
    assert all(rc == 0 for rc in bm.ref_counts)


def test_prefix_match_never_covers_the_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(list(range(8)))
    run_prefill(bm, a)
    b = seq(list(range(8)))           # identical: only the first block may be reused
    assert bm.match_prefix(b) == a.block_table[:1]


def test_chained_hash_distinguishes_equal_blocks_after_different_prefixes():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq([1, 2, 3, 4, 9, 9, 9, 9, 0])
    run_prefill(bm, a)
    b = seq([5, 6, 7, 8, 9, 9, 9, 9, 0])    # second block equal, first differs
    assert bm.match_prefix(b) == []


def test_hit_is_verified_against_stored_tokens():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq([1, 2, 3, 4, 0])
    run_prefill(bm, a)
    b = seq([7, 7, 7, 7, 0])
    # Forge a collision: b's first-block hash points at a's block.
    h = bm._hashes(b, 1)[0]
    bm.hash_to_block[h] = a.block_table[0]
    assert bm.match_prefix(b) == []


def test_unreferenced_cached_blocks_are_revived_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(list(range(9)))            # 3 blocks, 2 full ones cached
    run_prefill(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = seq(list(range(8)) + [77])
    hit = bm.match_prefix(b)
    assert len(hit) == 2
    run_prefill(bm, b)
    assert b.block_table[:2] == hit and all(bm.ref_counts[x] == 1 for x in hit)
    bm.free(b)
    # Fill the pool with unrelated tokens: the cached blocks get evicted.
    c = seq([100 + i for i in range(16)])
    run_prefill(bm, c)
    assert bm.match_prefix(seq(list(range(8)) + [77])) == []


def test_uncached_free_blocks_are_reused_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq(list(range(5)))            # block 0 full (cached), block 1 partial (not cached)
    run_prefill(bm, a)
    bm.free(a)
    c = seq([100, 101])                # needs one block: must not evict the cached one
    run_prefill(bm, c)
    assert len(bm.match_prefix(seq(list(range(5))))) == 1


def test_prefix_caching_off_never_matches():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    a = seq(list(range(10)))
    run_prefill(bm, a)
    assert bm.match_prefix(seq(list(range(10)))) == []
    assert bm.prefix_cache_hit_rate() == 0.0


@pytest.mark.parametrize("prompt_len", [3, 4, 5, 8, 9])
def test_decode_fits_is_needing_no_block_for_one_more_token(prompt_len):
    """The scheduler's steady-state test is the general rule's answer for one token: as a
    sequence grows, when a block fills, and when a fork shares its partly filled last block."""
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=False)
    s = seq(list(range(prompt_len)))
    bm.allocate(s, prompt_len)
    s.num_computed_tokens = prompt_len - 1          # its last token decodes next
    seen = set()
    for _ in range(9):
        fits = bm.decode_fits(s)
        assert fits == (bm.num_blocks_needed(s, 1) == 0)
        seen.add(fits)
        if bm.num_blocks_needed(s, 1):
            bm.allocate(s, 1)
        s.num_computed_tokens += 1
        s.token_ids.append(7)
    assert seen == {True, False}
    child = s.fork(1, seed=1)
    bm.fork(s, child)                               # the last block is shared now
    assert bm.decode_fits(s) == (bm.num_blocks_needed(s, 1) == 0)
    assert bm.decode_fits(child) == (bm.num_blocks_needed(child, 1) == 0)
