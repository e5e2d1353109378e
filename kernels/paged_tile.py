"""A tile of K/V rows in the paged cache, as decode and prefill attention both use it: where it
lies (the block-table lookup, ``kv_tile_rows``) and one online-softmax step over it
(``attend_tile``).

Why per page (when PER_PAGE_READS is on): a tile of BLOCK_N tokens spans BLOCK_N / PAGE pages
(or lies inside one page), so reading one table entry per page, not one per token, cuts the
dependent table loads that sit in front of every K/V load by PAGE times. That needs tiles aligned to BLOCK_N (both kernels'
tiles start at multiples of BLOCK_N) and a power-of-two page; other page sizes fall back to
one entry per token, which any page size allows.
"""

from __future__ import annotations

import triton
import triton.language as tl


# Whether tiles read the table once per page where the page allows. Off: the first H200 run
# with it on (16:01) measured decode 2-3x slower than the old per-token kernel, but that run
# changed the loop structure too, so the cause is not known; the GPU check's decode sweep
# measures both ways.
PER_PAGE_READS = False


def per_page_lookup(page: int) -> bool:
    """Whether tiles of a power-of-two BLOCK_N read the table once per page (PER_PAGE_READS and
    a power-of-two page) rather than once per token."""
    return PER_PAGE_READS and page > 0 and page & (page - 1) == 0


@triton.jit
def kv_tile_rows(table_row_ptr, start, seq_len, stride_blk, stride_tok,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PER_PAGE: tl.constexpr):
    """(row offsets [BLOCK_N] int64, valid [BLOCK_N]) of tokens start .. start + BLOCK_N - 1 of
    one sequence, whose block-table row starts at ``table_row_ptr``. ``start`` is a multiple of
    BLOCK_N below ``seq_len``; rows at or past ``seq_len`` are invalid (their table entries,
    padding the engine may leave as garbage, are never read)."""
    n = start + tl.arange(0, BLOCK_N).to(tl.int64)
    valid = n < seq_len
    if PER_PAGE:
        if PAGE >= BLOCK_N:                    # the whole tile lies in one page
            blk = tl.load(table_row_ptr + start // PAGE).to(tl.int64)
            rows = blk * stride_blk + (n % PAGE) * stride_tok
        else:
            page = start // PAGE + tl.arange(0, BLOCK_N // PAGE).to(tl.int64)
            blk = tl.load(table_row_ptr + page, mask=page * PAGE < seq_len, other=0).to(tl.int64)
            in_page = tl.arange(0, PAGE).to(tl.int64)
            rows = tl.reshape(blk[:, None] * stride_blk + in_page[None, :] * stride_tok, (BLOCK_N,))
    else:
        blk = tl.load(table_row_ptr + n // PAGE, mask=valid, other=0).to(tl.int64)
        rows = blk * stride_blk + (n % PAGE) * stride_tok
    return rows, valid


@triton.jit
def attend_tile(q, k_cache_ptr, v_cache_ptr, rows, n_ok, visible, d, d_ok, m, l, acc, qk_scale,
                PRECISION: tl.constexpr):
    """One online-softmax step of the query rows q [M, BLOCK_D] over the K/V rows at ``rows``
    (valid where ``n_ok``; scores kept where ``visible``, [M or 1, BLOCK_N]): the updated running
    max m, sum l and unnormalized output acc, fp32, in log2 units (qk_scale holds log2(e))."""
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    val = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, val, input_precision=PRECISION)
    return m_new, l, acc
