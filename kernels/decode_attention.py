"""paged_decode_attention: one new query token per sequence over its paged K/V context.

Design (why):
- GQA packing. One program serves one (sequence, KV head) and all GROUP = Hq / Hkv query heads
  that share that KV head, as the rows of a [BLOCK_G, D] tile. Each K/V tile is then read from
  memory once per group instead of once per query head, and the score product is a real
  `tl.dot`. Rows are padded to BLOCK_G >= 16 because tensor-core dots need M, K >= 16; padded rows
  compute on zeros and are never stored.
- Fixed-size splits. A sequence's context is cut into splits of ``split_tokens`` tokens (a
  constant, SPLIT_TOKENS), each producing a normalized partial output and its log-sum-exp; a
  second small kernel merges a sequence's splits in order (weights exp(lse_s - max lse)). The
  cut depends only on the sequence's own length, so its result does not depend on what else is
  in the batch, nor on how many programs run: the ground for a batch-invariant mode.
- Merge in the split kernel (FUSED_MERGE, off until a GPU measures it). At batch 8 / 4k the H200
  measured 44-48.5 us, as fast as a copy of the same bytes (which took 1.05x as long) yet 65-72%
  of the large copy's bandwidth: what is left is fixed cost, two launches (split, then merge)
  and the merge waiting for the split grid's last wave to drain. Fused, each program takes a
  ticket when its partials are stored (CTA barrier, then one thread's atomic add on the
  (sequence, KV head)'s int32 counter, acq_rel at GPU scope); the program with the last ticket
  merges that pair's splits right away (partials loaded .cg: other SMs wrote them, L1 may hold
  stale lines) and sets the counter back to 0, so the next call and every CUDA-graph replay
  start clean without a memset. Merges overlap the other pairs' split work and there is one
  launch. The merge is the merge kernel's own code (_merge_splits) in the same order, so both
  paths give the same bits (tested; the GPU check's sweep checks it on the GPU). Counters: one
  buffer per (device, stream), allocated once and grown, so calls in flight on two streams never
  share one; a CUDA graph keeps the buffer of the stream it was captured on (see _COUNTERS).
- Programs by occupancy. How many programs share a (sequence, KV head)'s splits (``num_splits``,
  each taking a contiguous run of them in one flat tile loop) is chosen so the SMs hold PROGRAMS_PER_SM each
  (FlashInfer's rule: fill what the SMs can hold, not one wave of the SM count), never more
  than there are splits. From shapes alone: no device sync, stable under CUDA graphs.
- Direct store. When the table's capacity fits one split, nothing is split and the one program
  writes the output (bit-equal to merging a single split: weight exp2(0) = 1).
- Paging. The block table is read per token (kernels/paged_tile.py); addresses are int64
  (pools > 2**31 elements).
- Precision. 16-bit K/V go into the dots natively with fp32 accumulation, P rounded to V's dtype
  (paged_tile.NATIVE_DOTS; bf16 is upcast to tf32 dots under the interpreter, which mishandles
  bf16 dots); fp32 inputs take ieee fp32 dots. Softmax uses exp2 with scale*log2(e) folded in.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

from tokenrelay.kernels import _validate as v
from tokenrelay.kernels.paged_tile import attend_tile, kv_tile_rows, native_dots
from tokenrelay.kernels.reference import paged_decode_attention_ref

__all__ = ["paged_decode_attention", "paged_decode_attention_ref", "choose_num_splits",
           "SPLIT_TOKENS"]

LOG2E = 1.4426950408889634
# The H200 run of 2026-12-04 16:57 (kernel_roofline's sweep, ctx 4096, bf16) chose 512 tokens x
# 2 programs per SM: 18.9 / 44.0 / 138.0 / 256.1 us at batch 1 / 8 / 32 / 64 (72-94% of copy at
# batch >= 8) against 16.7 / 48.5 / 144.9 / 267.1 us for 256 x 4.
# Tokens per split: small enough that a 4k context gives 16 splits to spread over the SMs at
# batch 1, big enough that the partials (GROUP x (D + 1) fp32 per split, written and read back)
# stay ~3% of the K/V bytes a split reads. A multiple of every BLOCK_N.
SPLIT_TOKENS = 512
# Decode programs one SM holds at once (4 warps each, K/V tiles in registers): the occupancy the
# grid is sized for. The GPU check's kernel_roofline section reports the neighbours.
PROGRAMS_PER_SM = 2
# Tokens per K/V tile (head_dim <= 128; half for bigger heads), warps per program and software
# pipeline stages. The 16:18 H200 run measured 64 / 4 / 2 with tf32 dots and the table read in
# the tile's own iteration: 71-72% of copy at batch 32-64. Triton's pipeliner then kept one K/V
# buffer whatever num_stages (a load whose address comes from a load of the same iteration);
# with PREFETCH_ROWS (the next tile's table entries read one iteration ahead) stages 3 keeps
# two, 4 three (sm_90 build: 78 KB of shared memory at 64 / 4 / 3). The GPU check's
# kernel_roofline section sweeps these against the 16:18 kernel.
BLOCK_N, NUM_WARPS, NUM_STAGES, PREFETCH_ROWS = 64, 4, 3, True
# Merge the splits in the split kernel itself (True: the last program of each (sequence, KV
# head) to finish, found by an atomic ticket, merges them; one launch) or in a second kernel
# (False). Same arithmetic in the same order: bit-equal results either way (tested). False until
# a GPU run measures the fused one (the GPU check's decode sweep prints both).
FUSED_MERGE = False
# The fused merge's ticket counters, int32, one per (sequence, KV head), all 0 between calls
# (the merging program resets its own). One buffer per (device, stream): two calls in flight on
# different streams never share a counter. Grown when a call needs more (a zeros launch, once),
# never shrunk; a replaced buffer is kept alive in _RETIRED, since a CUDA graph captured with it
# still uses it. A graph uses the buffer of the stream it was captured on: replay it on one
# stream, ordered with eager calls on that stream (as the engine does), never two replays that
# captured on the same stream concurrently.
_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []
_COUNTERS_LOCK = threading.Lock()
_MIN_COUNTERS = 1024


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, counters_ptr,
    qk_scale, max_splits,
    q_stride_b, q_stride_h, bt_stride,
    cache_stride_blk, cache_stride_tok, cache_stride_head,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT_TILES: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr,
    NATIVE: tl.constexpr, PREFETCH_ROWS: tl.constexpr, FUSED: tl.constexpr,
):
    # One flat, software-pipelined loop over this program's contiguous run of splits: at a
    # split's last tile its partial is stored and the running state restarts, exactly as a
    # fresh split would (so the result is the same whatever the run's length). A loop of
    # splits around a loop of tiles measured 2-3x slower than the old one-range kernel on an
    # H200 (16:01); likely cause: its software pipeline refilled at every split.
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    prog = tl.program_id(2).to(tl.int64)
    programs = tl.num_programs(2).to(tl.int64)
    num_heads = tl.num_programs(1).to(tl.int64) * GROUP

    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    num_tiles = (seq_len + BLOCK_N - 1) // BLOCK_N   # not tl.cdiv: a jit helper, slow when interpreted
    num_splits = (num_tiles + SPLIT_TILES - 1) // SPLIT_TILES
    per_prog = (num_splits + programs - 1) // programs
    tile_lo = prog * per_prog * SPLIT_TILES
    tile_hi = tl.minimum(tile_lo + per_prog * SPLIT_TILES, num_tiles)
    table_row_ptr = block_tables_ptr + b * bt_stride
    kv_head_off = kvh * cache_stride_head

    g = tl.arange(0, BLOCK_G).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    head = kvh * GROUP + g
    o_mask = g_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b * q_stride_b + head[:, None] * q_stride_h + d[None, :],
                mask=o_mask, other=0.0).to(tl.float32)
    if NATIVE:
        q = q.to(k_cache_ptr.dtype.element_ty)     # exact: q came in that dtype

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # PREFETCH_ROWS: each iteration reads the next tile's table entries, so this tile's K/V
    # addresses come from the previous iteration and the pipeliner can buffer them deeper.
    rows, n_ok = kv_tile_rows(table_row_ptr, tile_lo * BLOCK_N, seq_len, cache_stride_blk,
                              cache_stride_tok, PAGE, BLOCK_N)
    for tile in range(tile_lo, tile_hi):
        if PREFETCH_ROWS:
            cur_rows, cur_ok = rows, n_ok
            rows, n_ok = kv_tile_rows(table_row_ptr, (tile + 1) * BLOCK_N, seq_len,
                                      cache_stride_blk, cache_stride_tok, PAGE, BLOCK_N)
        else:
            cur_rows, cur_ok = kv_tile_rows(table_row_ptr, tile * BLOCK_N, seq_len,
                                            cache_stride_blk, cache_stride_tok, PAGE, BLOCK_N)
        m, l, acc = attend_tile(q, k_cache_ptr, v_cache_ptr, cur_rows + kv_head_off, cur_ok,
                                cur_ok[None, :], d, d_ok, m, l, acc, qk_scale, PRECISION, NATIVE)
        if not DIRECT:
            last = ((tile + 1) % SPLIT_TILES == 0) | (tile + 1 == num_tiles)
            if last:                             # a split holds >= 1 token: l > 0
                part = (b * num_heads + head) * max_splits + tile // SPLIT_TILES
                tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :],
                         acc / l[:, None], mask=o_mask)
                tl.store(part_lse_ptr + part, m + tl.log2(l), mask=g_ok)
            m = tl.where(last, float("-inf"), m)
            l = tl.where(last, 0.0, l)
            acc = tl.where(last, 0.0, acc)
    if DIRECT:      # the capacity fits one split: all of the sequence, stored as the output
        o = acc / tl.where(l > 0.0, l, 1.0)[:, None]
        o_ptr = out_ptr + (b * num_heads + head[:, None]) * HEAD_DIM + d[None, :]
        tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=o_mask)
    if FUSED:       # never with DIRECT: the last program of this (sequence, KV head) merges
        # Every program takes one ticket, with or without tiles, after its partials are
        # stored. The barrier orders all of this program's threads' stores before the ticket
        # (the scalar atomic is done by one thread); acq_rel at GPU scope publishes them to
        # the program that takes the last ticket and makes the others' visible to it.
        tl.debug_barrier()
        counter = counters_ptr + b * tl.num_programs(1) + kvh
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket == programs - 1:
            _merge_splits(out_ptr, part_out_ptr, part_lse_ptr, b, kvh, num_heads, num_splits,
                          max_splits, GROUP, HEAD_DIM, BLOCK_G, BLOCK_D, ".cg")
            # Back to 0 for the next call on this stream (and for CUDA-graph replays): every
            # program of this call has taken its ticket, so nothing else touches it now.
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _merge_splits(out_ptr, part_out_ptr, part_lse_ptr, b, kvh, num_heads, num_splits, max_splits,
                  GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_D: tl.constexpr, CACHE: tl.constexpr):
    """Merge one (sequence, KV head)'s ``num_splits`` partials, in order, into the output: the
    one arithmetic both paths run (so they agree bit for bit; padding rows of a larger BLOCK_G
    change no row's result). ``CACHE`` is the partials' load cache modifier: ".cg" (L2, not L1)
    where other SMs wrote them within this launch."""
    # Loops over the sequence's own splits, in order, instead of reducing a [G, S, D] tile:
    # splits are few, the loop keeps registers small on the GPU and avoids slow reductions in
    # the interpreter, and the order is fixed whatever the grid of the split kernel was.
    g = tl.arange(0, BLOCK_G).to(tl.int64)
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    g_ok = g < GROUP
    gd_mask = g_ok[:, None] & (d < HEAD_DIM)[None, :]
    part0 = (b * num_heads + kvh * GROUP + g) * max_splits                 # [G], split 0
    mx = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for s in range(num_splits):
        mx = tl.maximum(mx, tl.load(part_lse_ptr + part0 + s, mask=g_ok, other=float("-inf"),
                                    cache_modifier=CACHE))
    mx = tl.where(mx == float("-inf"), 0.0, mx)                             # no splits at all
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for s in range(num_splits):
        w = tl.exp2(tl.load(part_lse_ptr + part0 + s, mask=g_ok, other=float("-inf"),
                            cache_modifier=CACHE) - mx)
        po = tl.load(part_out_ptr + (part0 + s)[:, None] * HEAD_DIM + d[None, :], mask=gd_mask,
                     other=0.0, cache_modifier=CACHE)
        acc += w[:, None] * po
        total += w
    o = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    o_ptr = out_ptr + (b * num_heads + kvh * GROUP + g)[:, None] * HEAD_DIM + d[None, :]
    tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=gd_mask)


@triton.jit
def _decode_merge_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr, max_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    num_heads = tl.num_programs(1).to(tl.int64) * GROUP
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    num_splits = (seq_len + SPLIT_TOKENS - 1) // SPLIT_TOKENS
    _merge_splits(out_ptr, part_out_ptr, part_lse_ptr, b, kvh, num_heads, num_splits, max_splits,
                  GROUP, HEAD_DIM, BLOCK_G, BLOCK_D, "")


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # an H100/H200, so CPU runs pick what the GPU would


def _stream_key(device: torch.device) -> tuple[str, int]:
    """The (device, stream) whose counters a call uses: under CUDA-graph capture, the capture
    stream. Host-side only (no sync)."""
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        return f"cuda:{stream.device_index}", stream.cuda_stream
    return str(device), 0


def merge_counters(device: torch.device, needed: int) -> torch.Tensor:
    """The current stream's ticket counters for the fused merge, at least ``needed`` of them,
    all 0 (see FUSED_MERGE). Allocated once per (device, stream) and size, grown by doubling."""
    key = _stream_key(device)
    with _COUNTERS_LOCK:
        buf = _COUNTERS.get(key)
        if buf is None or buf.numel() < needed:
            size = max(needed, _MIN_COUNTERS, 0 if buf is None else 2 * buf.numel())
            if buf is not None:
                _RETIRED.append(buf)
            buf = _COUNTERS[key] = torch.zeros(size, dtype=torch.int32, device=device)
        return buf


def choose_num_splits(batch: int, num_kv_heads: int, max_splits: int, num_sms: int) -> int:
    """Programs per (sequence, KV head): enough for every SM to hold PROGRAMS_PER_SM, never more
    than the table's capacity has splits (``max_splits``), and none without a split of a full
    table to take. Shapes only: no device sync."""
    wanted = max(1, min(triton.cdiv(num_sms * PROGRAMS_PER_SM, max(batch * num_kv_heads, 1)),
                        max_splits))
    # Each program takes ceil(max_splits / programs) splits; as many programs as that share
    # needs, so none is left idle (8 splits over 5 programs would be 2, 2, 2, 2 and nothing).
    return int(triton.cdiv(max_splits, triton.cdiv(max_splits, wanted)))


def _config(head_dim: int, split_tokens: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_N): BLOCK_N tokens for heads up to 128 dims, half that for bigger heads
    (the tile's bytes stay the same), halved until it divides a split (splits end on tiles)."""
    block_d = max(16, v.next_pow2(head_dim))
    block_n = BLOCK_N if block_d <= 128 else BLOCK_N // 2
    while split_tokens % block_n:
        block_n //= 2
    return block_d, block_n


def _check(query, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, split_tokens) -> None:
    if num_splits is not None and not (isinstance(num_splits, int) and num_splits >= 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    if not (isinstance(split_tokens, int) and split_tokens >= 64 and split_tokens % 64 == 0):
        raise ValueError(f"split_tokens must be a positive multiple of 64 (every BLOCK_N divides "
                         f"it), got {split_tokens!r}")
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
    *,
    split_tokens: int = SPLIT_TOKENS,
) -> torch.Tensor:
    """query [B, Hq, D] over caches [num_blocks, page, Hkv, D] -> out [B, Hq, D] (query dtype).

    seq_lens[b] counts the context including the token being decoded (already stored); a 0 gives
    a zero row. A sequence's context is attended in splits of ``split_tokens`` tokens, merged in
    order; ``num_splits`` is how many programs share a (sequence, KV head)'s splits (None: by
    occupancy, see choose_num_splits). The result does not depend on ``num_splits`` nor on the
    rest of the batch. Reads no tensor value on the host (no device sync).
    """
    _check(query, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, split_tokens)
    batch, num_heads, head_dim = query.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = v.new_buffer((batch, num_heads, head_dim), query.dtype, query.device)
    if batch == 0:
        return out
    block_d, block_n = _config(head_dim, split_tokens)
    max_splits = triton.cdiv(max(block_tables.shape[1] * page, 1), split_tokens)
    direct = max_splits == 1
    programs = 1 if direct else (num_splits or choose_num_splits(
        batch, num_kv_heads, max_splits, _num_sms(query.device)))
    fused = FUSED_MERGE and not direct
    if direct:
        part_out = part_lse = out  # unused
    else:
        part_out = v.new_buffer((batch, num_heads, max_splits, head_dim), torch.float32, query.device)
        part_lse = v.new_buffer((batch, num_heads, max_splits), torch.float32, query.device)
    # the counters, or any int32 pointer when they go unused
    counters = merge_counters(query.device, batch * num_kv_heads) if fused else seq_lens
    _decode_split_kernel[(batch, num_kv_heads, min(programs, max_splits))](
        query, k_cache, v_cache, block_tables, seq_lens,
        out, part_out, part_lse, counters,
        scale * LOG2E, max_splits,
        query.stride(0), query.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, HEAD_DIM=head_dim, PAGE=page,
        BLOCK_G=max(16, v.next_pow2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        SPLIT_TILES=split_tokens // block_n, DIRECT=direct,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        NATIVE=native_dots(query.dtype), PREFETCH_ROWS=PREFETCH_ROWS, FUSED=fused,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    if not (direct or fused):
        _decode_merge_kernel[(batch, num_kv_heads)](
            out, part_out, part_lse, seq_lens, max_splits,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_G=v.next_pow2(group), BLOCK_D=block_d,
            SPLIT_TOKENS=split_tokens, num_warps=4,
        )
    return out
