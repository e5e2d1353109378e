"""Paged attention, torch backend: metadata, KV store and attention reading from the paged cache.

The cache of a layer is ``k_cache, v_cache: [num_blocks, block_size, Hkv, D]``. On CPU decode
attention is memory-bound: the cost is moving K/V. In float32 with ``compiled=True`` decodes run
the inductor kernel of engine/compiled_decode.py, which reads each block once in place. The
eager path (other dtypes, ``enforce_eager``, no compiler) sorts decodes by length and attends
them in small groups: one gather of just the blocks they need into a reused buffer, padded only
to the longest member, then one SDPA with an additive mask. Each prefill sequence runs its own
unpadded causal SDPA. How a step's batch splits is computed once per step and shared by every
layer (``_plan_for``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import compiled_decode


@dataclass
class AttentionMetadata:
    """Per-step batch layout shared by every layer (see docs/contracts.md)."""

    slot_mapping: torch.Tensor      # [T] int64, cache slot of each new token (-1 = do not store)
    block_tables: torch.Tensor      # [B, max_blocks] int32, physical block ids, padded with 0
    seq_lens: torch.Tensor          # [B] int32, context length per sequence INCLUDING new tokens
    context_lens: torch.Tensor      # [B] int32, tokens already cached before this step
    cu_seqlens_q: torch.Tensor      # [B+1] int32, prefix sums of new-token counts per sequence
    max_seqlen_q: int
    max_seqlen_k: int
    is_decode: bool                 # every sequence has exactly one new token


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key/value[T, Hkv, D]`` into the flat slots ``slot_mapping[T]``; -1 skips a token."""
    num_blocks, block_size, hkv, d = k_cache.shape
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    k_cache.view(num_blocks * block_size, hkv, d).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, hkv, d).index_copy_(0, slots, value.to(v_cache.dtype))


class _Workspace(threading.local):
    """Reused gather buffers. A fresh multi-MB tensor per layer per step costs more in page
    faults than the copy itself on CPU (measured ~5x), so K and V gathers write into buffers
    that only grow. Thread-local, so two engines on two threads never share a buffer."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device, bool], torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # Inference tensors cannot be written outside inference mode (and vice versa for
        # autograd), so each mode gets its own buffers.
        key = (name, dtype, device, torch.is_inference_mode_enabled())
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[key] = buf
        return buf[:numel]


_WORKSPACE = _Workspace()


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, name: str) -> torch.Tensor:
    """``[len(blocks) * block_size, Hkv, D]``: the given cache blocks, in order, in a reused buffer.

    ``index_select`` on the flat block table is markedly faster on CPU than advanced indexing."""
    _, block_size, hkv, d = cache.shape
    if cache.device.type != "cpu":
        return cache.index_select(0, blocks).view(-1, hkv, d)
    out = _WORKSPACE.get(name, blocks.numel() * block_size * hkv * d, cache.dtype, cache.device)
    torch.index_select(cache, 0, blocks, out=out.view(-1, block_size, hkv, d))
    return out.view(-1, hkv, d)


# Decode sequences are attended in groups of at most this many, sorted by length: padding to the
# longest member of a group of similar lengths wastes little (one padded batch of 48 gathered ~2x
# the needed KV and took ~2x longer, measured on the bench model). Whole-workload runs with fresh
# prompts each (so the prefix cache cannot help): 8 gave 316-360 output tok/s against 280-319 for
# 16, with OpenMP threads spinning or sleeping (OMP_WAIT_POLICY=PASSIVE) alike; 4 was close to 8.
# Smaller groups keep each gathered K/V (~2.4 MB at 300 keys) nearer the cores' caches.
_DECODE_GROUP = 8


@dataclass
class _DecodeGroup:
    q_rows: torch.Tensor            # [m] int64, the query rows (tokens) this group holds
    blocks: torch.Tensor            # [m * nblk] int64, their first nblk blocks, row by row
    num_keys: int                   # nblk * block_size
    mask: torch.Tensor | None       # [m, 1, 1, num_keys] additive float mask, None if all full


@dataclass
class _PrefillSeq:
    start: int                      # first row of this sequence in the ragged query
    q_len: int
    seq_len: int
    blocks: torch.Tensor            # [nblk] int64


class _Plan:
    """How a step's batch is split for attention: decode groups and per-sequence prefills.

    It depends only on block tables and lengths, which every layer shares, so it is built once
    per step (the first layer) and reused by the others; see :func:`_plan_for`."""

    def __init__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 q_lens: list[int], block_size: int, dtype: torch.dtype) -> None:
        lens = seq_lens.tolist()
        starts = [0] * len(q_lens)          # first query row of each sequence
        for i in range(1, len(q_lens)):
            starts[i] = starts[i - 1] + q_lens[i - 1]
        tables = block_tables.long()
        self.block_size = block_size
        self.dtype = dtype
        self.lens, self.starts, self.tables = lens, starts, tables
        # Decodes longest first; their groups are built for whichever path asks (one does).
        self.decodes = sorted((i for i, q in enumerate(q_lens) if q == 1), key=lambda i: -lens[i])
        self._eager_groups: list[_DecodeGroup] | None = None
        self._compiled_groups: list[compiled_decode.CompiledGroup] | None = None
        self.prefills = [_PrefillSeq(starts[i], q, lens[i], tables[i, :-(-lens[i] // block_size)])
                         for i, q in enumerate(q_lens) if q > 1]

    def eager_groups(self) -> list[_DecodeGroup]:
        """Groups of :data:`_DECODE_GROUP` decodes for gather + SDPA (built on first use)."""
        if self._eager_groups is None:
            self._eager_groups = [self._eager_group(self.decodes[g:g + _DECODE_GROUP])
                                  for g in range(0, len(self.decodes), _DECODE_GROUP)]
        return self._eager_groups

    def _eager_group(self, rows: list[int]) -> _DecodeGroup:
        bs, lens, device = self.block_size, self.lens, self.tables.device
        n = -(-lens[rows[0]] // bs)
        rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
        mask = None
        if any(lens[r] != n * bs for r in rows):
            keys = torch.arange(n * bs, device=device)
            row_lens = torch.tensor([lens[r] for r in rows], device=device)
            mask = torch.zeros(len(rows), n * bs, dtype=self.dtype, device=device)
            mask.masked_fill_(keys[None, :] >= row_lens[:, None], float("-inf"))
            mask = mask[:, None, None, :]
        q_rows = torch.tensor([self.starts[r] for r in rows], dtype=torch.int64, device=device)
        return _DecodeGroup(q_rows, self.tables[rows_t, :n].reshape(-1), n * bs, mask)

    def compiled_groups(self) -> list[compiled_decode.CompiledGroup]:
        """The decodes as groups for the compiled kernel (built on first use)."""
        if self._compiled_groups is None:
            self._compiled_groups = compiled_decode.build_groups(
                self.decodes, self.starts, self.lens, self.tables, self.block_size, self.dtype)
        return self._compiled_groups


class _PlanCache(threading.local):
    """The plan of the last step and copies of the metadata it was built from."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.plan: _Plan | None = None


_PLANS = _PlanCache()


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.device == b.device and bool(torch.equal(a, b))


def _plan_for(block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
              block_size: int, dtype: torch.dtype) -> _Plan:
    """The step's plan, built at the first layer and reused while equal metadata comes back.

    Compared by value (a few hundred ints, microseconds), not identity: a caller may refill
    the same tensors in place between steps."""
    key = (block_tables, seq_lens, cu_seqlens_q)
    cached = _PLANS.key
    if (cached is not None and cached[3:] == (block_size, dtype)
            and all(_same(a, b) for a, b in zip(cached[:3], key))):
        return _PLANS.plan
    if cu_seqlens_q is None:
        q_lens = [1] * seq_lens.shape[0]
    else:
        cu = cu_seqlens_q.tolist()
        q_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    plan = _Plan(block_tables, seq_lens, q_lens, block_size, dtype)
    _PLANS.key = tuple(None if t is None else t.clone() for t in key) + (block_size, dtype)
    _PLANS.plan = plan
    return plan


def _decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _Plan,
            out: torch.Tensor, scale: float, compiled: bool) -> None:
    """One query per sequence: writes the rows of ``out`` that the plan's decodes hold.

    ``compiled`` (CPU float32 only): the inductor kernel of engine/compiled_decode.py, which
    reads the blocks in place; this eager path is the fallback when it cannot be built."""
    if not plan.decodes:
        return
    if compiled and query.dtype == torch.float32 and query.device.type == "cpu":
        if _decode_compiled(query, k_cache, v_cache, plan, out, scale):
            return
    _decode_eager(query, k_cache, v_cache, plan.eager_groups(), out, scale)


def _decode_compiled(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     plan: _Plan, out: torch.Tensor, scale: float) -> bool:
    for g in plan.compiled_groups():
        o = compiled_decode.run_group(query.index_select(0, g.q_rows), k_cache, v_cache, g,
                                      scale)
        if o is None:           # compiling is impossible here: the eager path redoes all rows
            return False
        out.index_copy_(0, g.q_rows, o)
    return True


def _decode_eager(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  groups: list[_DecodeGroup], out: torch.Tensor, scale: float) -> None:
    """Gather each group's blocks, then one SDPA. GQA is folded into the query length
    (``[m, Hkv, G, D]``), so K/V are never repeated."""
    _, hq, d = query.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    for g in groups:
        m = g.q_rows.numel()
        k = _gather_blocks(k_cache, g.blocks, "k").view(m, g.num_keys, hkv, d).transpose(1, 2)
        v = _gather_blocks(v_cache, g.blocks, "v").view(m, g.num_keys, hkv, d).transpose(1, 2)
        q = query.index_select(0, g.q_rows).view(m, hkv, group, d)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=g.mask,
                                           scale=scale)
        out.index_copy_(0, g.q_rows, o.reshape(m, hq, d))


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None, *, compiled: bool = False
                           ) -> torch.Tensor:
    """One new query per sequence, ``query[B, Hq, D]`` -> ``[B, Hq, D]``; ``num_splits`` is a
    kernel tuning knob and is ignored here. ``compiled``: see :func:`_decode`."""
    plan = _plan_for(block_tables, seq_lens, None, k_cache.shape[1], query.dtype)
    out = torch.empty_like(query)
    _decode(query, k_cache, v_cache, plan, out, scale, compiled)
    return out


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, scale: float, *,
                            compiled: bool = False) -> torch.Tensor:
    """Ragged causal attention for ``query[T, Hq, D]`` (new tokens of B sequences, concatenated)
    against the cache, which must already hold the new tokens' K/V; covers chunked prefill and
    cached prefixes (context_len = seq_len - q_len).

    Sequences with a single new token (decodes batched with a prefill chunk) take the grouped
    decode path. The others run one SDPA each, unpadded: prefill is compute-bound, so padding
    ragged chunks to a common length wasted more than the per-sequence call costs."""
    _, hq, d = query.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    plan = _plan_for(block_tables, seq_lens, cu_seqlens_q, k_cache.shape[1], query.dtype)
    out = torch.empty_like(query)
    _decode(query, k_cache, v_cache, plan, out, scale, compiled)
    for p in plan.prefills:
        k = _gather_blocks(k_cache, p.blocks, "k")[:p.seq_len].to(query.dtype)
        v = _gather_blocks(v_cache, p.blocks, "v")[:p.seq_len].to(query.dtype)
        if group > 1:   # flash attention on CPU wants equal head counts; prefill is compute-bound
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
        q = query[p.start:p.start + p.q_len].transpose(0, 1)[None]     # [1, Hq, Lq, D]
        context = p.seq_len - p.q_len
        mask = None
        if context:
            # Query i sits at position context + i and sees keys <= it.
            keys = torch.arange(p.seq_len, device=query.device)
            q_pos = context + torch.arange(p.q_len, device=query.device)
            mask = torch.zeros(p.q_len, p.seq_len, dtype=query.dtype, device=query.device)
            mask.masked_fill_(keys[None, :] > q_pos[:, None], float("-inf"))
        o = F.scaled_dot_product_attention(q, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=mask, is_causal=not context, scale=scale)
        out[p.start:p.start + p.q_len] = o[0].transpose(0, 1)
    return out
