"""paged_prefill_attention: ragged causal attention for new tokens over a cached prefix.

Runs after store_kv, so every key (prefix and new tokens alike) is read from the paged cache and a
prefix-cache hit costs nothing special: sequence b's q_len = cu[b+1] - cu[b] new queries sit at
positions context_len .. seq_len - 1, with context_len = seq_len - q_len.

Design (why):
- GQA packing as in decode: a program owns one (sequence, query tile, KV head) and stacks its
  BLOCK_Q tokens x GROUP query heads as the BLOCK_M rows of one tile (row r = token r // GP,
  head r % GP, GP = GROUP rounded up to a power of two), so each K/V tile is loaded once per group.
- Causality per row: key n is visible to token t iff n <= context_len + t; the key loop stops at
  the tile's last visible key, so the upper triangle beyond it is never read, and the key tiles
  every row of the query tile sees skip the mask (only the diagonal's build it).
- One flat grid of query tiles, sized from shapes alone: sequence b's tiles are numbered from
  cu[b] // BLOCK_Q + b, so num_tokens // BLOCK_Q + batch programs cover every span and each
  program finds its sequence by a binary search over cu_seqlens_q. The launcher never reads the
  longest span on the host (that was a device sync per layer). Tiles past a span do no work.
- The block table is read per key (kernels/paged_tile.py); 16-bit K/V are dotted natively
  (paged_tile.NATIVE_DOTS), fp32 accumulation.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from tokenrelay.kernels import _validate as v
from tokenrelay.kernels.decode_attention import LOG2E
from tokenrelay.kernels.paged_tile import attend_tile, kv_tile_rows, native_dots
from tokenrelay.kernels.reference import paged_prefill_attention_ref

__all__ = ["paged_prefill_attention", "paged_prefill_attention_ref"]

# Query rows per tile (tokens x GQA heads), warps per program, keys per tile (head_dim <= 128;
# half for bigger heads) and pipeline stages. With tf32 dots, 128 rows x 8 warps measured 41.3
# TFLOP/s on the H200 (16:18), 64 x 4 39.4 (34% of SDPA flash); the GPU check's kernel_roofline
# section sweeps these, and PREFETCH_ROWS (decode_attention.py says why).
# With native 16-bit dots the 16:57 sweep measured 64 rows x 4 warps at 145.8 TFLOP/s (1.26x
# SDPA flash on the same spans) against 132.4 for 128 x 8.
TILE_ROWS, NUM_WARPS, BLOCK_N, NUM_STAGES, PREFETCH_ROWS = 64, 4, 64, 3, True


@triton.jit
def _sequence_of_tile(cu_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The last sequence b whose first tile, cu[b] // BLOCK_Q + b, is <= tile (binary search)."""
    lo = tile * 0
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(cu_ptr + mid) // BLOCK_Q + mid
        right = first <= tile
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    return lo - 1


@triton.jit
def _attend_keys(q, k_cache_ptr, v_cache_ptr, table_row_ptr, head_off, lo, hi, kv_end, limit,
                 d, d_ok, m, l, acc, qk_scale, stride_blk, stride_tok,
                 PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                 NATIVE: tl.constexpr, PREFETCH_ROWS: tl.constexpr, MASKED: tl.constexpr):
    """The online-softmax state after keys lo .. hi - 1 (lo a multiple of BLOCK_N; keys from
    kv_end on are invalid), causally masked by ``limit`` where MASKED. PREFETCH_ROWS: each
    iteration reads the next tile's table entries (as in decode), so K/V addresses do not hang on
    a load of the same iteration and the pipeliner can buffer them deeper."""
    nxt_row, nxt_ok = kv_tile_rows(table_row_ptr, lo, kv_end, stride_blk, stride_tok, PAGE,
                                   BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        if PREFETCH_ROWS:
            row, n_ok = nxt_row, nxt_ok
            nxt_row, nxt_ok = kv_tile_rows(table_row_ptr, start + BLOCK_N, kv_end, stride_blk,
                                           stride_tok, PAGE, BLOCK_N)
        else:
            row, n_ok = kv_tile_rows(table_row_ptr, start, kv_end, stride_blk, stride_tok, PAGE,
                                     BLOCK_N)
        if MASKED:
            n = start + tl.arange(0, BLOCK_N).to(tl.int64)
            visible = n_ok[None, :] & (n[None, :] <= limit[:, None])
        else:
            visible = n_ok[None, :]
        m, l, acc = attend_tile(q, k_cache_ptr, v_cache_ptr, row + head_off, n_ok, visible, d,
                                d_ok, m, l, acc, qk_scale, PRECISION, NATIVE)
    return m, l, acc


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, cu_ptr, out_ptr,
    qk_scale, num_seqs,
    q_stride_t, q_stride_h, bt_stride,
    cache_stride_blk, cache_stride_tok, cache_stride_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_GP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, NATIVE: tl.constexpr,
    PREFETCH_ROWS: tl.constexpr,
):
    # BLOCK_M = BLOCK_Q tokens x BLOCK_GP heads
    tile = tl.program_id(0)
    kvh = tl.program_id(1).to(tl.int64)
    num_heads = tl.num_programs(1).to(tl.int64) * GROUP
    b32 = _sequence_of_tile(cu_ptr, num_seqs, tile, BLOCK_Q)
    q_start32 = tl.load(cu_ptr + b32)
    q_tile = (tile - (q_start32 // BLOCK_Q + b32)).to(tl.int64)
    b = b32.to(tl.int64)

    q_start = q_start32.to(tl.int64)
    q_len = tl.load(cu_ptr + b + 1).to(tl.int64) - q_start
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    context_len = seq_len - q_len
    t0 = q_tile * BLOCK_Q

    r = tl.arange(0, BLOCK_M).to(tl.int64)
    t = t0 + r // BLOCK_GP
    g = r % BLOCK_GP
    row_ok = (t < q_len) & (g < GROUP)
    head = kvh * GROUP + g
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_ok = d < HEAD_DIM
    q_mask = row_ok[:, None] & d_ok[None, :]
    q_rows = (q_start + t) * q_stride_t + head * q_stride_h
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=q_mask, other=0.0).to(tl.float32)
    if NATIVE:
        q = q.to(k_cache_ptr.dtype.element_ty)     # exact: q came in that dtype
    limit = context_len + t                     # last key position each row may see

    kv_end = tl.minimum(seq_len, context_len + t0 + BLOCK_Q)
    kv_end = tl.where(t0 < q_len, kv_end, 0)     # tile past the span: no work
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys up to context_len + t0 are visible to every row of the tile: those whole tiles skip
    # the causal mask; only the last one or two tiles, on the diagonal, build it.
    full_end = tl.minimum(kv_end, (context_len + t0 + 1) // BLOCK_N * BLOCK_N)
    table_row_ptr = block_tables_ptr + b * bt_stride
    head_off = kvh * cache_stride_head
    m, l, acc = _attend_keys(q, k_cache_ptr, v_cache_ptr, table_row_ptr, head_off, 0, full_end,
                             kv_end, limit, d, d_ok, m, l, acc, qk_scale, cache_stride_blk,
                             cache_stride_tok, PAGE, BLOCK_N, PRECISION, NATIVE, PREFETCH_ROWS,
                             False)
    m, l, acc = _attend_keys(q, k_cache_ptr, v_cache_ptr, table_row_ptr, head_off, full_end,
                             kv_end, kv_end, limit, d, d_ok, m, l, acc, qk_scale,
                             cache_stride_blk, cache_stride_tok, PAGE, BLOCK_N, PRECISION,
                             NATIVE, PREFETCH_ROWS, True)

    o = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    o_rows = (q_start + t) * num_heads + head
    tl.store(out_ptr + o_rows[:, None] * HEAD_DIM + d[None, :], o.to(out_ptr.dtype.element_ty), mask=q_mask)


def _check(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale) -> None:
    v.check_paged_attention(query, k_cache, v_cache, block_tables, seq_lens, scale,
                            batch_from_query=False)
    batch = seq_lens.shape[0]
    v.check_tensor("cu_seqlens_q", cu_seqlens_q, 1, (torch.int32,), query.device)
    v.check_contiguous("cu_seqlens_q", cu_seqlens_q)
    if cu_seqlens_q.shape[0] != batch + 1:
        raise ValueError(f"seq_lens {tuple(seq_lens.shape)} and cu_seqlens_q "
                         f"{tuple(cu_seqlens_q.shape)} disagree on the batch (need batch + 1 offsets)")
    if v.value_checks_enabled():
        v.cu_seqlens_values(cu_seqlens_q, seq_lens, query.shape[0])


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """query [T, Hq, D] (sequence b = rows cu[b]:cu[b+1]) -> out [T, Hq, D] in query's dtype."""
    _check(query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale)
    num_tokens, num_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = v.new_buffer((num_tokens, num_heads, head_dim), query.dtype, query.device)
    batch = seq_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    block_gp = v.next_pow2(group)
    block_d = max(16, v.next_pow2(head_dim))
    block_m = max(TILE_ROWS, block_gp)
    block_n = BLOCK_N if block_d <= 128 else BLOCK_N // 2
    block_q = block_m // block_gp
    grid = (num_tokens // block_q + batch, num_kv_heads)        # see "One flat grid" above
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out,
        scale * LOG2E, batch,
        query.stride(0), query.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, HEAD_DIM=head_dim, PAGE=page,
        BLOCK_GP=block_gp, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_N=block_n,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        NATIVE=native_dots(query.dtype), PREFETCH_ROWS=PREFETCH_ROWS,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return out
