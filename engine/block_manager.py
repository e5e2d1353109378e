"""BlockManager: the paged KV cache's bookkeeping (which physical block holds which tokens).

The cache is ``num_blocks`` blocks of ``block_size`` token slots. Each sequence owns a block
table: its i-th block holds its tokens ``[i*block_size, (i+1)*block_size)``. Blocks are ref
counted so that sequences sharing a prompt prefix can share the full blocks of that prefix.

Prefix caching: every *full* block is identified by a hash chained over the previous block's
hash and its own token ids, so equal hashes mean equal whole prefixes. A hit is verified against
the stored (parent hash, token ids) key, so a hash collision can never serve wrong KV. Blocks
nobody references stay in the free queue with their contents and hash intact, reusable until a
fresh allocation evicts them, least recently freed first.

Forks (parallel samples, beams): ``fork`` gives a sibling the same block table, one more
reference on each block. Full blocks are never written again, so sharing them is free; the one
partly filled last block is copied when a sibling first writes into it while others still hold
it (copy on write): ``allocate`` swaps in a fresh block and records (source, destination) in
``pending_copies`` for the model runner to copy before the step's forward pass.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional

from tokenrelay.engine.block_tables import BlockTables
from tokenrelay.engine.sequence import Sequence


@dataclass(frozen=True)
class KVCacheStats:
    """The pool as it stands (the engine publishes these in ``stats()``)."""

    blocks_total: int
    blocks_used: int
    block_size: int
    prefix_cache_hit_rate: float        # cached tokens / prompt tokens admitted
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int      # prompt tokens looked up in the prefix cache


class NoFreeBlocksError(RuntimeError):
    """Internal: an allocation was attempted without checking ``can_allocate`` first."""


@dataclass(frozen=True)
class PoolShape:
    """The pool's size alone: what checking whether a request could ever fit needs. The
    engine's front end (engine/llm_engine.py, engine/core_client.py) checks requests with it
    before they reach the core, which may run in another process."""

    num_blocks: int
    block_size: int

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def pool_shortfall(self, num_tokens: int) -> Optional[str]:
        """None if a sequence of ``num_tokens`` tokens fits in the whole pool; otherwise why
        not, with the numbers (for the error its request gets)."""
        need = self.blocks_for(num_tokens)
        if need <= self.num_blocks:
            return None
        return (f"needs {need} KV blocks of {self.block_size} tokens, the pool has "
                f"{self.num_blocks}")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 tables: Optional[BlockTables] = None):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, "
                             f"{block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.shape = PoolShape(num_blocks, block_size)
        # Every block table, mirrored for the model runner (which reads the same object).
        self.tables = tables if tables is not None else BlockTables()
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[Optional[int]] = [None] * num_blocks
        self.block_key: list[Optional[tuple]] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # Blocks with ref count 0, in eviction order (front is reused first). Blocks without a
        # hash go to the front: reusing them costs nothing, evicting cached ones loses a prefix.
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # Copy-on-write copies (src, dst) decided by allocate, run before the next forward.
        self.pending_copies: list[tuple[int, int]] = []
        # Prefix cache statistics (tokens):
        self.num_query_tokens = 0
        self.num_hit_tokens = 0

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def blocks_for(self, num_tokens: int) -> int:
        return self.shape.blocks_for(num_tokens)

    def prefix_cache_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0

    def stats(self) -> KVCacheStats:
        return KVCacheStats(self.num_blocks, self.num_used_blocks, self.block_size,
                            self.prefix_cache_hit_rate(), self.num_hit_tokens,
                            self.num_query_tokens)

    def num_shared_blocks(self) -> int:
        """Blocks held by more than one sequence (shared prefixes, forked choices)."""
        return sum(1 for rc in self.ref_counts if rc > 1)

    def num_shared_token_copies(self, seqs: Iterable[Sequence]) -> int:
        """Token slots a sum of ``num_computed_tokens`` over ``seqs`` counts more than once:
        a block held by r of them adds ``(r - 1)`` times the tokens it holds."""
        holders: dict[int, list[int]] = {}
        for s in seqs:
            for i, b in enumerate(s.block_table):
                filled = min(self.block_size, max(0, s.num_computed_tokens - i * self.block_size))
                holders.setdefault(b, []).append(filled)
        return sum(sum(f) - max(f) for f in holders.values() if len(f) > 1)

    # -- prefix cache ----------------------------------------------------------------------
    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The chained hashes of the sequence's first ``num_blocks`` full blocks (memoized)."""
        hashes = seq.block_hashes
        bs = self.block_size
        tokens = seq.token_ids
        prev = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            prev = hash((prev, tuple(tokens[i * bs:(i + 1) * bs])))
            hashes.append(prev)
        return hashes

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the sequence's leading tokens; takes no references.

        At most ``num_tokens - 1`` tokens are matched: the last token must be computed anyway,
        because its logits are what the next sample needs.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._hashes(seq, max_blocks)
        bs = self.block_size
        matched: list[int] = []
        prev: Optional[int] = None
        for i in range(max_blocks):
            h = hashes[i]
            block = self.hash_to_block.get(h)
            if block is None or self.block_key[block] != (prev, tuple(seq.token_ids[i * bs:(i + 1) * bs])):
                break
            matched.append(block)
            prev = h
        return matched

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_query_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    # -- allocation ------------------------------------------------------------------------
    def _needs_copy(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Would writing the next tokens land in a partly filled block others still hold?"""
        c = seq.num_computed_tokens
        if num_new_tokens <= 0 or c % self.block_size == 0:
            return False
        i = c // self.block_size
        return i < len(seq.block_table) and self.ref_counts[seq.block_table[i]] > 1

    def decode_fits(self, seq: Sequence) -> bool:
        """Does one more token go into a slot ``seq`` already holds alone (no fresh block, no
        copy on write)? ``num_blocks_needed(seq, 1) == 0`` in one cheap test: the scheduler
        asks it of every decoding sequence every step."""
        c, table, bs = seq.num_computed_tokens, seq.block_table, self.block_size
        return c < len(table) * bs and not (c % bs and self.ref_counts[table[c // bs]] > 1)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int,
                          cached_blocks: Iterable[int] = ()) -> int:
        """Free-queue blocks an ``allocate`` call would consume (fresh, copied, revived)."""
        if not cached_blocks:  # the per-step path of every running sequence
            total = seq.num_computed_tokens + num_new_tokens
            fresh = max(0, -(-total // self.block_size) - len(seq.block_table))
            return fresh + self._needs_copy(seq, num_new_tokens)
        cached = list(cached_blocks)
        have = len(seq.block_table) + len(cached)
        total_tokens = seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        fresh = max(0, self.blocks_for(total_tokens) - have)
        revived = sum(1 for b in cached if self.ref_counts[b] == 0)
        return fresh + revived

    def can_allocate(self, seq: Sequence, num_new_tokens: int,
                     cached_blocks: Iterable[int] = ()) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens, cached_blocks) <= len(self.free_queue)

    def allocate(self, seq: Sequence, num_new_tokens: int,
                 cached_blocks: Iterable[int] = ()) -> None:
        """Give ``seq`` blocks for ``num_new_tokens`` more tokens after its computed ones.

        ``cached_blocks`` (only for a sequence holding no blocks) are prefix-cache hits from
        ``match_prefix``; the caller advances ``num_computed_tokens`` past them.
        """
        cached = list(cached_blocks)
        if cached and seq.block_table:
            raise ValueError("cached blocks can only start an empty block table")
        needed = self.num_blocks_needed(seq, num_new_tokens, cached)
        if needed > len(self.free_queue):
            raise NoFreeBlocksError(
                f"{seq.request_id}: need {needed} blocks, {len(self.free_queue)} free")
        if needed == 0 and not cached:      # most decode steps: the last block has room
            return
        start = len(seq.block_table)
        for b in cached:
            if self.ref_counts[b] == 0:
                del self.free_queue[b]
            self.ref_counts[b] += 1
        if cached:
            seq.block_table.extend(cached)
            seq.num_cached_blocks = len(cached)
        if self._needs_copy(seq, num_new_tokens):
            i = seq.num_computed_tokens // self.block_size
            src = seq.block_table[i]
            self.ref_counts[src] -= 1
            dst = self._take_fresh_block()
            seq.block_table[i] = dst
            self.pending_copies.append((src, dst))
            if i < start:
                self.tables.set(seq, i)
        total_tokens = seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        for _ in range(self.blocks_for(total_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_fresh_block())
        if len(seq.block_table) > start:
            self.tables.extend(seq, start)

    def _take_fresh_block(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:  # evict its cached contents
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
            self.block_hash[block] = None
            self.block_key[block] = None
        self.ref_counts[block] = 1
        return block

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` (made by ``parent.fork``) now holds every block of ``parent`` too."""
        if child.block_table != parent.block_table:
            raise ValueError("fork: the child must start with the parent's block table")
        for b in child.block_table:
            self.ref_counts[b] += 1
        self.tables.copy(parent, child)

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies decided since the last call, for the model runner."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references. Tail blocks first, so they are evicted first."""
        for block in reversed(seq.block_table):
            rc = self.ref_counts[block] - 1
            if rc < 0:
                raise RuntimeError(f"block {block} ref count went negative")
            self.ref_counts[block] = rc
            if rc == 0:
                self.free_queue[block] = None
                if self.block_hash[block] is None:
                    self.free_queue.move_to_end(block, last=False)
        seq.block_table = []
        seq.num_cached_blocks = 0
        self.tables.release(seq)

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed blocks to the prefix cache.

        Called after a step computed tokens: a block is full once all its slots hold KV. If an
        identical block is already published (two equal prompts in one step), this one simply
        stays private.
        """
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_cached_blocks:
            return
        hashes = self._hashes(seq, num_full)
        bs = self.block_size
        for i in range(seq.num_cached_blocks, num_full):
            block = seq.block_table[i]
            h = hashes[i]
            if self.block_hash[block] is None and h not in self.hash_to_block:
                self.block_hash[block] = h
                self.block_key[block] = (hashes[i - 1] if i else None,
                                         tuple(seq.token_ids[i * bs:(i + 1) * bs]))
                self.hash_to_block[h] = block
        seq.num_cached_blocks = num_full
