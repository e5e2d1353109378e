"""paged_decode_attention: one new query token per sequence over its paged K/V context.

Design (why):
- GQA packing. One program serves one (sequence, KV head, split) and all GROUP = Hq / Hkv query
  heads that share that KV head, as the rows of a [BLOCK_G, D] tile. Each K/V tile is then read
  from memory once per group instead of once per query head, and the score product is a real
  `tl.dot`. Rows are padded to BLOCK_G >= 16 because tensor-core dots need M, K >= 16; padded rows
  compute on zeros and are never stored.
- Split-K. With few sequences (small batch) there are too few (sequence, KV head) programs to fill
  the GPU, so the context is cut into num_splits contiguous ranges of BLOCK_N-token tiles, each
  producing a normalized partial output and its log-sum-exp; a second small kernel merges them
  (weights exp(lse_s - max lse)). One split writes the output directly and skips stage 2.
- Paging. Each K/V row's address comes from its own block-table entry (position // block_size),
  so any block_size works and tiles may straddle pages. Addresses are int64 (pools > 2**31 elements).
- Precision. Loads are upcast to fp32 at once (the interpreter mishandles raw bf16 arithmetic); the
  dots run on fp32 operands as tf32 for 16-bit inputs — exact for values that came from fp16/bf16
  — and as full ieee fp32 for fp32 inputs. Softmax uses exp2 with scale*log2(e) folded in.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from tokenrelay.kernels import _validate as v
from tokenrelay.kernels.reference import paged_decode_attention_ref

__all__ = ["paged_decode_attention", "paged_decode_attention_ref", "choose_num_splits"]

LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, num_splits,
    q_stride_b, q_stride_h, bt_stride,
    cache_stride_blk, cache_stride_tok, cache_stride_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2).to(tl.int64)
    num_heads = tl.num_programs(1).to(tl.int64) * GROUP

    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    num_tiles = (seq_len + BLOCK_N - 1) // BLOCK_N   # not tl.cdiv: a jit helper, slow when interpreted
    per_split = (num_tiles + num_splits - 1) // num_splits
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, num_tiles)

    g = tl.arange(0, BLOCK_G).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    head = kvh * GROUP + g
    q = tl.load(q_ptr + b * q_stride_b + head[:, None] * q_stride_h + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile in range(tile_lo, tile_hi):
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
        n_ok = n < seq_len
        blk = tl.load(block_tables_ptr + b * bt_stride + n // PAGE, mask=n_ok, other=0).to(tl.int64)
        row = blk * cache_stride_blk + (n % PAGE) * cache_stride_tok + kvh * cache_stride_head
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        val = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, val, input_precision=PRECISION)
        m = m_new

    has = l > 0.0
    o = acc / tl.where(has, l, 1.0)[:, None]
    o_mask = g_ok[:, None] & d_ok[None, :]
    if DIRECT:
        o_ptr = out_ptr + (b * num_heads + head[:, None]) * HEAD_DIM + d[None, :]
        tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        part = (b * num_heads + head) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], o, mask=o_mask)
        lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=g_ok)


@triton.jit
def _decode_merge_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Loops over the splits instead of reducing a [G, S, D] tile: splits are few, the loop keeps
    # registers small on the GPU and avoids slow reductions in the interpreter.
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    num_heads = tl.num_programs(1).to(tl.int64) * GROUP
    g = tl.arange(0, BLOCK_G).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    g_ok = g < GROUP
    gd_mask = g_ok[:, None] & (d < HEAD_DIM)[None, :]
    part0 = (b * num_heads + kvh * GROUP + g) * num_splits                 # [G], split 0
    mx = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for s in range(num_splits):
        mx = tl.maximum(mx, tl.load(part_lse_ptr + part0 + s, mask=g_ok, other=float("-inf")))
    mx = tl.where(mx == float("-inf"), 0.0, mx)                             # all splits empty
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s in range(num_splits):
        w = tl.exp2(tl.load(part_lse_ptr + part0 + s, mask=g_ok, other=float("-inf")) - mx)  # 0 if empty
        po = tl.load(part_out_ptr + (part0 + s)[:, None] * HEAD_DIM + d[None, :], mask=gd_mask, other=0.0)
        acc += w[:, None] * po
        total += w
    o = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    o_ptr = out_ptr + (b * num_heads + kvh * GROUP + g)[:, None] * HEAD_DIM + d[None, :]
    tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=gd_mask)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H100/H200, so CPU runs pick what the GPU would


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, block_n: int, num_sms: int) -> int:
    """Enough (sequence, KV head, split) programs for ~2 waves, each split >= 4 tiles of work.

    Shape-only on purpose (max_context is the block table's capacity, not the live maximum): it
    needs no device sync, so it is stable under CUDA-graph capture and replay.
    """
    tiles = triton.cdiv(max(max_context, 1), block_n)
    wanted = triton.cdiv(2 * num_sms, max(batch * num_kv_heads, 1))
    return int(max(1, min(wanted, tiles // 4, 64)))


def _config(head_dim: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_N): one fixed config; 64 tokens x 128 dims keeps K and V tiles in registers."""
    block_d = max(16, v.next_pow2(head_dim))
    return block_d, (64 if block_d <= 128 else 32)


def _check(query, k_cache, v_cache, block_tables, seq_lens, scale, num_splits) -> None:
    if num_splits is not None and not (isinstance(num_splits, int) and num_splits >= 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    v.check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, scale,
                            batch_from_query=True)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """query [B, Hq, D] over caches [num_blocks, page, Hkv, D] -> out [B, Hq, D] (query dtype).

    seq_lens[b] counts the context including the token being decoded (already stored); a 0 gives
    a zero row. num_splits None picks one from the shapes (see choose_num_splits).
    """
    _check(query, k_cache, v_cache, block_tables, seq_lens, scale, num_splits)
    batch, num_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = v.new_buffer((batch, num_heads, head_dim), query.dtype, query.device)
    if batch == 0:
        return out
    block_d, block_n = _config(head_dim)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, block_tables.shape[1] * page, block_n,
                                       _num_sms(query.device))
    direct = num_splits == 1
    if direct:
        part_out = part_lse = out  # unused
    else:
        part_out = v.new_buffer((batch, num_heads, num_splits, head_dim), torch.float32, query.device)
        part_lse = v.new_buffer((batch, num_heads, num_splits), torch.float32, query.device)
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens,
        out, part_out, part_lse,
        scale * LOG2E, num_splits,
        query.stride(0), query.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, HEAD_DIM=head_dim, PAGE=page,
        BLOCK_G=max(16, v.next_pow2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        DIRECT=direct, PRECISION=precision,
        num_warps=4, num_stages=2,
    )
    if not direct:
        _decode_merge_kernel[(batch, num_kv_heads)](
            out, part_out, part_lse, num_splits,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_G=v.next_pow2(group), BLOCK_D=block_d,
            num_warps=4,
        )
    return out
