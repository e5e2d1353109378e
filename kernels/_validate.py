"""Launcher-side checks, raising ValueError before any kernel runs.

Why in Python: `tl.device_assert` never fires in the interpreter, and an out-of-bounds index on the
GPU corrupts memory silently (or kills the process in the interpreter).

Two kinds. Checks of types, shapes, dtypes and strides read only host metadata: every call runs
them. Checks of tensor *values* (index bounds, cu_seqlens) read the device: each is a device-to-host
sync, ~0.57 ms a call on an H200 (issue #38), paid by every layer of every step. So a launcher
never runs them unless ``TOKENRELAY_KERNEL_CHECKS=1`` (the debug flag, ``DEBUG_VALUE_CHECKS``);
the engine checks the step's values once, on the host copies it built them in, before they go to
the device (:func:`check_step_values`, called by the ModelRunner). Never during CUDA-graph capture,
where a sync is forbidden.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Tests set this so every buffer a launcher allocates starts as NaN: an element the kernel forgets
# to write then fails the comparison instead of passing by luck (torch.empty often returns zeros).
POISON_OUTPUTS = False
INDEX_DTYPES = (torch.int32, torch.int64)
CHECKS_ENV = "TOKENRELAY_KERNEL_CHECKS"


def _debug_flag_from_env() -> bool:
    raw = os.environ.get(CHECKS_ENV, "0")
    if raw not in ("0", "1"):
        raise ValueError(f"{CHECKS_ENV} must be 0 or 1, got {raw!r}")
    return raw == "1"


# Per-call value checks in every launcher (a device sync each): for debugging, off by default.
DEBUG_VALUE_CHECKS = _debug_flag_from_env()


def value_checks_enabled() -> bool:
    """Launchers check tensor values only under the debug flag, and never while a CUDA graph is
    being captured (reading values would sync and break capture)."""
    if not DEBUG_VALUE_CHECKS:
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def check_tensor(
    name: str,
    t: object,
    ndim: int,
    dtypes: Iterable[torch.dtype],
    device: torch.device | None = None,
) -> torch.Tensor:
    """Type, rank, dtype and device of one argument."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dtypes = tuple(dtypes)
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} dtype must be one of {dtypes}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    return t


def check_contiguous(name: str, t: torch.Tensor) -> None:
    """Whole-tensor contiguity (caches, index tensors)."""
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {t.stride()})")


def check_rows_contiguous(name: str, t: torch.Tensor) -> None:
    """Everything but dim 0 packed densely, so a view of a fused projection (qkv split) is accepted."""
    expected = 1
    for dim in range(t.dim() - 1, 0, -1):
        if t.shape[dim] > 1 and t.stride(dim) != expected:
            raise ValueError(f"{name} must be contiguous past dim 0 (strides {t.stride()})")
        expected *= t.shape[dim]
    if t.shape[0] > 1 and t.stride(0) < expected:
        raise ValueError(f"{name} rows overlap (strides {t.stride()})")


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def check_same_dtype(names: str, *tensors: torch.Tensor) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise ValueError(f"{names} must share one dtype, got {sorted(map(str, dtypes))}")


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, device: torch.device) -> None:
    """Both caches [num_blocks, block_size, Hkv, D], same shape and dtype, contiguous."""
    check_tensor("k_cache", k_cache, 4, FLOAT_DTYPES, device)
    check_tensor("v_cache", v_cache, 4, FLOAT_DTYPES, device)
    check_shape("v_cache", v_cache, tuple(k_cache.shape))
    check_same_dtype("k_cache and v_cache", k_cache, v_cache)
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)


def check_range(name: str, t: torch.Tensor, low: int, high: int, what: str) -> None:
    """Under the debug flag: every value in [low, high) (see :func:`values_in_range`)."""
    if value_checks_enabled():
        values_in_range(name, t, low, high, what)


def values_in_range(name: str, t: torch.Tensor, low: int, high: int, what: str) -> None:
    """Every value in [low, high); the message names the worst offender. Reads the values."""
    if t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    if lo < low:
        raise ValueError(f"{name} has value {lo} < {low} ({what})")
    if hi >= high:
        raise ValueError(f"{name} has value {hi} >= {high} ({what})")


def block_table_values(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """seq_lens fit the table's width, and every *used* table entry names a real block.

    Entries past a sequence's last page are padding (often 0) and are never read, so they are not
    checked — the engine may leave garbage there. Reads the values.
    """
    batch, width = block_tables.shape
    values_in_range("seq_lens", seq_lens, 0, width * block_size + 1,
                    f"at most block_tables.shape[1] * block_size = {width * block_size}")
    if batch == 0 or width == 0:
        return
    pages_used = (seq_lens.long() + block_size - 1) // block_size
    used = torch.arange(width, device=block_tables.device)[None, :] < pages_used[:, None]
    entries = block_tables[used]
    values_in_range("block_tables", entries, 0, num_blocks, f"num_blocks = {num_blocks}")


def cu_seqlens_values(cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int) -> None:
    """cu_seqlens_q runs from 0 to num_tokens without decreasing, and no sequence has more new
    tokens than its length. Reads the values."""
    cu = cu_seqlens_q.tolist()
    if cu[0] != 0 or cu[-1] != num_tokens:
        raise ValueError(f"cu_seqlens_q must run from 0 to num_tokens = {num_tokens}, got {cu[0]}..{cu[-1]}")
    q_lens = [hi - lo for lo, hi in zip(cu[:-1], cu[1:])]
    for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens.tolist())):
        if q_len < 0:
            raise ValueError(f"cu_seqlens_q decreases at sequence {b} ({cu[b]} -> {cu[b + 1]})")
        if q_len > seq_len:
            raise ValueError(f"sequence {b} has {q_len} new tokens but seq_len {seq_len}")


def check_step_values(*, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, num_blocks: int,
                      block_size: int) -> None:
    """A step's index values, once per step, on the host tensors the engine built (so no device
    sync): what every launcher of the step would otherwise check per call, under the debug flag.
    """
    named = {"slot_mapping": slot_mapping, "block_tables": block_tables, "seq_lens": seq_lens,
             "cu_seqlens_q": cu_seqlens_q}
    for name, t in named.items():
        if t.device.type != "cpu":
            raise ValueError(f"check_step_values reads values: pass the host {name}, not one on "
                             f"{t.device} (that read would sync the device)")
    values_in_range("slot_mapping", slot_mapping, -1, num_blocks * block_size,
                    f"-1 or below num_blocks * block_size = {num_blocks * block_size}")
    block_table_values(block_tables, seq_lens, num_blocks, block_size)
    cu_seqlens_values(cu_seqlens_q, seq_lens, slot_mapping.shape[0])


def new_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty, or NaN-filled when POISON_OUTPUTS is set."""
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                          batch_from_query: bool) -> None:
    """The checks decode and prefill attention share: query vs paged caches (dtype, head_dim, GQA
    ratio, layout), int32 contiguous tables of one row per sequence, a finite scale, in-range
    pages. Decode has one query row per sequence (``batch_from_query``); prefill is ragged."""
    check_tensor("query", query, 3, FLOAT_DTYPES)
    dev = query.device
    check_kv_cache(k_cache, v_cache, dev)
    check_tensor("block_tables", block_tables, 2, (torch.int32,), dev)
    check_tensor("seq_lens", seq_lens, 1, (torch.int32,), dev)
    num_heads, head_dim = query.shape[1:]
    batch = query.shape[0] if batch_from_query else seq_lens.shape[0]
    num_blocks, page, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {cache_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} not a multiple of KV heads {num_kv_heads}")
    check_same_dtype("query and the caches", query, k_cache)
    check_rows_contiguous("query", query)
    check_contiguous("block_tables", block_tables)
    check_contiguous("seq_lens", seq_lens)
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} / seq_lens {tuple(seq_lens.shape)} "
                         f"disagree with batch {batch}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if value_checks_enabled():
        block_table_values(block_tables, seq_lens, num_blocks, page)
