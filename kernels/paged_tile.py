"""A tile of K/V rows in the paged cache, as decode and prefill attention both use it: where it
lies (the block-table lookup, ``kv_tile_rows``) and one online-softmax step over it
(``attend_tile``).

The table is read once per token of a tile (the entries of one page hit the same cache line).
Reading it once per page, reshaping a [pages, PAGE] tile of offsets to [BLOCK_N], measured 2-4x
slower on an H200 (16:18 run) and was dropped.

Native dots (NATIVE_DOTS): 16-bit K and V go into ``tl.dot`` as they are, with fp32
accumulation, and the probabilities are rounded to V's dtype for P x V, as FlashAttention does.
That halves the registers and shared memory a tile takes against upcasting to fp32 (tf32 dots),
so more of the tile loop can be in flight. fp32 inputs always take ieee fp32 dots.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


# 16-bit K/V straight into the dots (True) or upcast to fp32 first (False: tf32 dots, the 16:18
# kernel); the GPU check's kernel_roofline section measures both.
NATIVE_DOTS = True


def native_dots(dtype: torch.dtype) -> bool:
    """Whether the attention kernels dot ``dtype`` K/V natively. Never fp32 (ieee instead), and
    never bf16 under Triton's interpreter, whose bf16 ``tl.dot`` returns garbage (measured: errors
    of 1e10); fp16 runs natively there, so the interpreter tests that path too."""
    if not NATIVE_DOTS or dtype == torch.float32:
        return False
    return not (dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def kv_tile_rows(table_row_ptr, start, seq_len, stride_blk, stride_tok,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """(row offsets [BLOCK_N] int64, valid [BLOCK_N]) of tokens start .. start + BLOCK_N - 1 of
    one sequence, whose block-table row starts at ``table_row_ptr``. Rows at or past ``seq_len``
    are invalid (their table entries, padding the engine may leave as garbage, are never read)."""
    n = start + tl.arange(0, BLOCK_N).to(tl.int64)
    valid = n < seq_len
    blk = tl.load(table_row_ptr + n // PAGE, mask=valid, other=0).to(tl.int64)
    return blk * stride_blk + (n % PAGE) * stride_tok, valid


@triton.jit
def attend_tile(q, k_cache_ptr, v_cache_ptr, rows, n_ok, visible, d, d_ok, m, l, acc, qk_scale,
                PRECISION: tl.constexpr, NATIVE: tl.constexpr):
    """One online-softmax step of the query rows q [M, BLOCK_D] (the cache's dtype when NATIVE,
    else fp32) over the K/V rows at ``rows`` (valid where ``n_ok``; scores kept where
    ``visible``, [M or 1, BLOCK_N]): the updated running max m, sum l and unnormalized output acc,
    fp32, in log2 units (qk_scale holds log2(e))."""
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if NATIVE:
        s = tl.dot(q, tl.trans(k))
    else:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=PRECISION)
    s = tl.where(visible, s * qk_scale, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    val = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
    if NATIVE:
        pv = tl.dot(p.to(val.dtype), val)
    else:
        pv = tl.dot(p, val.to(tl.float32), input_precision=PRECISION)
    return m_new, l, acc * alpha[:, None] + pv
