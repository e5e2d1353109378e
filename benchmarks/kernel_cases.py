"""Benchmark cases: each kernel with its reference, inputs, and the bytes (and flops) one call
must move, at realistic ("full") or tiny ("small", interpreter-friendly) sizes.

Full sizes are Llama-3-8B's: 32 query heads, 8 KV heads, head_dim 128, hidden 4096, MLP 14336,
16-token pages. The KV pool is large enough (2**31 / (16 * 8 * 128) = 131072 blocks would just
reach it) that any 32-bit element offset would wrap: sequences get blocks drawn from the whole
pool, including its top, so an int32 overflow shows up as a wrong answer.
"""

from __future__ import annotations

import itertools

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tokenrelay.kernels import ops as kernels
from tokenrelay.kernels._testing import random_block_tables

FULL = dict(heads=32, kv_heads=8, head_dim=128, hidden=4096, inter=14336, page=16,
            pool_blocks=160_000, decode_ctx=4096, decode_batches=(1, 8, 32, 64),
            prefill_spans=[(1024, 512), (0, 1000), (3000, 1), (200, 300)], tokens=2048)
SMALL = dict(heads=8, kv_heads=2, head_dim=32, hidden=64, inter=48, page=16,
             pool_blocks=24, decode_ctx=100, decode_batches=(3,),
             prefill_spans=[(0, 5), (20, 7), (3, 1)], tokens=5)


@dataclass
class Case:
    kernel: str
    label: str
    args: tuple
    nbytes: int                                   # minimum bytes one call reads + writes
    flops: int = 0
    mutated: tuple[int, ...] = ()                 # arg positions changed in place (compared)
    kwargs: dict[str, Any] = field(default_factory=dict)

    def fns(self) -> tuple[Callable, Callable]:
        return getattr(kernels, self.kernel), getattr(kernels, f"{self.kernel}_ref")


def _nb(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device).normal_()


def decode_cases(sz: dict, dtype: torch.dtype, device: str, pool: tuple) -> list[Case]:
    k_cache, v_cache = pool
    out = []
    for batch in sz["decode_batches"]:
        lens = [max(1, sz["decode_ctx"] - 7 * b) for b in range(batch)]      # ragged near ctx
        table = random_block_tables(lens, sz["page"], k_cache.shape[0]).to(device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        query = _randn((batch, sz["heads"], sz["head_dim"]), dtype, device)
        row = sz["kv_heads"] * sz["head_dim"] * k_cache.element_size()
        nbytes = 2 * sum(lens) * row + 2 * _nb(query) + _nb(table, seq_lens)
        flops = 4 * sum(lens) * sz["heads"] * sz["head_dim"]
        out.append(Case("paged_decode_attention", f"batch {batch} ctx {sz['decode_ctx']}",
                        (query, k_cache, v_cache, table, seq_lens, sz["head_dim"] ** -0.5),
                        nbytes, flops))
    return out


def prefill_case(sz: dict, dtype: torch.dtype, device: str, pool: tuple) -> Case:
    k_cache, v_cache = pool
    spans = sz["prefill_spans"]
    lens, q_lens = [c + n for c, n in spans], [n for _, n in spans]
    table = random_block_tables(lens, sz["page"], k_cache.shape[0]).to(device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
    query = _randn((sum(q_lens), sz["heads"], sz["head_dim"]), dtype, device)
    row = sz["kv_heads"] * sz["head_dim"] * k_cache.element_size()
    nbytes = 2 * sum(lens) * row + 2 * _nb(query)
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in spans)                 # causal (q, k) pairs
    return Case("paged_prefill_attention", f"spans {spans}",
                (query, k_cache, v_cache, table, seq_lens, cu,
                 sz["head_dim"] ** -0.5), nbytes, 4 * pairs * sz["heads"] * sz["head_dim"])


def store_kv_case(sz: dict, dtype: torch.dtype, device: str, pool: tuple) -> Case:
    k_cache, v_cache = pool
    n = sz["tokens"]
    key = _randn((n, sz["kv_heads"], sz["head_dim"]), dtype, device)
    value = _randn((n, sz["kv_heads"], sz["head_dim"]), dtype, device)
    total = k_cache.shape[0] * k_cache.shape[1]
    slots = torch.randperm(total, device=device)[:n]
    slots[0] = total - 1                                                     # the very last slot
    slots[n // 2] = -1
    return Case("store_kv", f"{n} tokens", (key, value, k_cache, v_cache, slots), 2 * _nb(key, value),
                mutated=(2, 3))


def pointwise_cases(sz: dict, dtype: torch.dtype, device: str) -> list[Case]:
    n, hidden, inter, hd = sz["tokens"], sz["hidden"], sz["inter"], sz["head_dim"]
    x, res, w = (_randn((n, hidden), dtype, device), _randn((n, hidden), dtype, device),
                 _randn((hidden,), dtype, device))
    q = _randn((n, sz["heads"], hd), dtype, device)
    k = _randn((n, sz["kv_heads"], hd), dtype, device)
    max_pos = 8192 if n > 64 else 64
    angles = torch.rand(max_pos, hd // 2, device=device) * 6.3
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1)
    positions = torch.randint(0, max_pos, (n,), device=device)
    gate_up = _randn((n, 2 * inter), dtype, device)
    return [
        Case("rms_norm", f"{n}x{hidden}", (x, w, 1e-6), 2 * _nb(x) + _nb(w)),
        Case("fused_add_rms_norm", f"{n}x{hidden}", (x, res, w, 1e-6), 4 * _nb(x) + _nb(w), mutated=(1,)),
        Case("rotary", f"{n} tokens neox", (q, k, positions, cache, True),
             2 * _nb(q, k) + n * hd * 4, mutated=(0, 1)),
        Case("silu_and_mul", f"{n}x{inter}", (gate_up,), _nb(gate_up) * 3 // 2),
    ]


def all_cases(small: bool, dtype: torch.dtype, device: str) -> list[Case]:
    sz = SMALL if small else FULL
    shape = (sz["pool_blocks"], sz["page"], sz["kv_heads"], sz["head_dim"])
    pool = (_randn(shape, dtype, device), _randn(shape, dtype, device))
    return [store_kv_case(sz, dtype, device, pool), *decode_cases(sz, dtype, device, pool),
            prefill_case(sz, dtype, device, pool), *pointwise_cases(sz, dtype, device)]
