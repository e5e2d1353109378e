"""Random paged-attention cases, shared by the tests and `benchmarks.kernels` (the same builders at
small and at realistic sizes).

Why this shape of data: caches are filled with random normal values *everywhere* (including
blocks no sequence owns) and block tables are random permutations of the pool, so reading a wrong
page or a wrong slot changes the answer; unused table entries are 0, as the engine pads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    query: torch.Tensor            # decode: [B, Hq, D]; prefill: [T, Hq, D]
    k_cache: torch.Tensor          # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor     # [B, M] int32
    seq_lens: torch.Tensor         # [B] int32
    cu_seqlens_q: torch.Tensor     # [B+1] int32 (decode: 0..B)
    scale: float


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device).normal_()


def random_block_tables(
    seq_lens: list[int], block_size: int, num_blocks: int, width: int | None = None
) -> torch.Tensor:
    """Each sequence gets distinct random blocks from the whole pool (ids up to num_blocks - 1)."""
    pages = [(s + block_size - 1) // block_size for s in seq_lens]
    if sum(pages) > num_blocks:
        raise ValueError(f"{sum(pages)} pages needed, pool has {num_blocks}")
    width = max(width or 0, max(pages, default=0), 1)
    ids = torch.randperm(num_blocks)[: sum(pages)]
    table = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        table[b, :n] = ids[start : start + n].to(torch.int32)
        start += n
    return table


def make_case(
    seq_lens: list[int],
    q_lens: list[int] | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    num_blocks: int | None = None,
) -> PagedCase:
    """Decode case when q_lens is None (one query per sequence), else a ragged prefill case."""
    pages = sum((s + block_size - 1) // block_size for s in seq_lens)
    num_blocks = num_blocks or pages + 3
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    lens = q_lens if q_lens is not None else [1] * len(seq_lens)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    num_q = len(seq_lens) if q_lens is None else int(cu[-1])
    return PagedCase(
        query=_randn((num_q, num_heads, head_dim), dtype, device),
        k_cache=_randn(cache_shape, dtype, device),
        v_cache=_randn(cache_shape, dtype, device),
        block_tables=random_block_tables(seq_lens, block_size, num_blocks).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=cu.to(device),
        scale=head_dim ** -0.5,
    )


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """assert_close tolerances that hold for kernel vs reference (see the interpreter notes)."""
    return {
        torch.float32: {"rtol": 1e-5, "atol": 1e-5},
        torch.float16: {"rtol": 2e-3, "atol": 2e-3},
        torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
    }[dtype]
