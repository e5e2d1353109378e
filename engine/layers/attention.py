"""Paged attention, torch backend: metadata, KV store and attention reading from the paged cache.

The cache of a layer is ``k_cache, v_cache: [num_blocks, block_size, Hkv, D]``. On CPU decode
attention is memory-bound: the cost is moving K/V. In float32 with ``compiled=True`` decodes run
the inductor kernel of compiled_decode.py, which reads each block once in place. The
eager path (other dtypes, ``enforce_eager``, no compiler) sorts decodes by length and attends
them in small groups: one gather of just the blocks they need into a reused buffer, padded only
to the longest member, then one SDPA with an additive mask. Each prefill sequence runs its own
unpadded causal SDPA. How a step's batch splits is the step's :class:`AttentionPlan`
(attention_plan.py): the ModelRunner builds it once per step and passes it down in the
metadata, so every layer reuses it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenrelay.engine.layers import compiled_decode
from tokenrelay.engine.layers.attention_plan import AttentionPlan, DecodeGroup


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
    # The step's attention plan (attention_plan.py), built once by the ModelRunner for
    # the torch backends and read by every layer; None for the triton kernels, which need none.
    plan: AttentionPlan | None = None


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


def _step_plan(plan: AttentionPlan | None, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               cu_seqlens_q: torch.Tensor | None, block_size: int,
               dtype: torch.dtype) -> AttentionPlan:
    """The plan the caller passed (the ModelRunner's, built once per step), checked against
    this call's shapes; without one, a plan for this call alone."""
    if plan is None:
        return AttentionPlan.for_step(block_tables, seq_lens, cu_seqlens_q, block_size, dtype)
    if (plan.num_seqs, plan.block_size, plan.dtype) != (seq_lens.shape[0], block_size, dtype):
        raise ValueError(f"the attention plan is for {plan.num_seqs} sequences in blocks of "
                         f"{plan.block_size} ({plan.dtype}), this call has {seq_lens.shape[0]} "
                         f"in blocks of {block_size} ({dtype}): pass the plan built for this "
                         "step's metadata")
    return plan


def _decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan,
            out: torch.Tensor, scale: float, compiled: bool) -> None:
    """One query per sequence: writes the rows of ``out`` that the plan's decodes hold.

    ``compiled`` (CPU float32 only): the inductor kernel of compiled_decode.py, which
    reads the blocks in place; this eager path is the fallback when it cannot be built."""
    if not plan.decodes:
        return
    if compiled and query.dtype == torch.float32 and query.device.type == "cpu":
        if _decode_compiled(query, k_cache, v_cache, plan, out, scale):
            return
    _decode_eager(query, k_cache, v_cache, plan.eager_groups(), out, scale)


def _decode_compiled(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     plan: AttentionPlan, out: torch.Tensor, scale: float) -> bool:
    for g in plan.compiled_groups():
        o = compiled_decode.run_group(query.index_select(0, g.q_rows), k_cache, v_cache, g,
                                      scale)
        if o is None:           # compiling is impossible here: the eager path redoes all rows
            return False
        out.index_copy_(0, g.q_rows, o)
    return True


def _decode_eager(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  groups: list[DecodeGroup], out: torch.Tensor, scale: float) -> None:
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
                           num_splits: int | None = None, *, compiled: bool = False,
                           plan: AttentionPlan | None = None) -> torch.Tensor:
    """One new query per sequence, ``query[B, Hq, D]`` -> ``[B, Hq, D]``; ``num_splits`` is a
    kernel tuning knob and is ignored here. ``compiled``: see :func:`_decode`; ``plan``: the
    step's plan (see :class:`AttentionMetadata`), built here when not given."""
    plan = _step_plan(plan, block_tables, seq_lens, None, k_cache.shape[1], query.dtype)
    out = torch.empty_like(query)
    _decode(query, k_cache, v_cache, plan, out, scale, compiled)
    return out


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, scale: float, *,
                            compiled: bool = False,
                            plan: AttentionPlan | None = None) -> torch.Tensor:
    """Ragged causal attention for ``query[T, Hq, D]`` (new tokens of B sequences, concatenated)
    against the cache, which must already hold the new tokens' K/V; covers chunked prefill and
    cached prefixes (context_len = seq_len - q_len).

    Sequences with a single new token (decodes batched with a prefill chunk) take the grouped
    decode path. The others run one SDPA each, unpadded: prefill is compute-bound, so padding
    ragged chunks to a common length wasted more than the per-sequence call costs."""
    _, hq, d = query.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    plan = _step_plan(plan, block_tables, seq_lens, cu_seqlens_q, k_cache.shape[1], query.dtype)
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
