"""Decode attention for CPU float32, compiled by torch.compile (inductor) to read the paged cache
in place.

The eager path (attention.py) first copies each sequence's blocks into a contiguous
buffer and then runs SDPA on it: the K/V bytes cross the memory bus three times (read, write,
read again), and decode attention is memory-bound. :func:`decode_math` states the same
attention as plain tensor algebra over ``k_cache[blocks]``; inductor fuses the indexing into
the reductions, so each block is read once, where it lies. Measured on the bench model (2 cores,
40 sequences of 200-560 tokens, 8 layers): 19-21 ms a step against 26-29 ms eager, and 30% less
time in the engine's decode steps. Run eagerly, the same code would materialize a
``[m, blocks, block_size, Hkv, G, D]`` product, so it must only ever run compiled.

One compiled graph serves every batch: the number of sequences, blocks per sequence and pool
blocks are marked dynamic, and groups are padded to at least two sequences of two blocks
(dynamo specializes sizes 0 and 1, which would mean more compiles). Compiling and its fallback:
compiled.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenrelay.engine.layers.compiled import LazyCompiled, mark_dynamic

# Sequences per compiled call, sorted by length so a group pads little. Engine bench, three
# alternating runs each: one call for the whole batch 499-523 output tok/s against 527-540 for
# 16 (padding every sequence to the longest costs more than the calls it saves); 8 was within
# noise of 16.
GROUP = 16
_MIN = 2            # dynamo specializes sizes 0 and 1: pad groups to at least this many


def decode_math(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                blocks: torch.Tensor, bias: torch.Tensor, scale: float) -> torch.Tensor:
    """``q[m, Hq, D]`` attends to the blocks ``blocks[m, n]`` of its sequence; ``bias[m, n, bs]``
    is 0 for a real key and -inf for a padded one. Returns ``[m, Hq, D]``.

    GQA is a view (``[m, 1, 1, Hkv, G, D]`` against keys ``[m, n, bs, Hkv, 1, D]``), never a copy.
    """
    m, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    qq = q.view(m, 1, 1, hkv, group, d)
    scores = (qq * k_cache[blocks].unsqueeze(-2)).sum(-1) * scale + bias[..., None, None]
    scores = scores - scores.amax(dim=(1, 2), keepdim=True)        # [m, n, bs, Hkv, G]
    weights = scores.exp()
    out = (weights.unsqueeze(-1) * v_cache[blocks].unsqueeze(-2)).sum(dim=(1, 2))
    out = out / weights.sum(dim=(1, 2)).unsqueeze(-1)              # [m, Hkv, G, D]
    return out.reshape(m, hq, d)


@dataclass
class CompiledGroup:
    q_rows: torch.Tensor        # [m] int64, the query rows this group holds
    blocks: torch.Tensor        # [m_pad, n_pad] int64
    bias: torch.Tensor          # [m_pad, n_pad, block_size] float, 0 or -inf


def build_groups(rows: list[int], q_rows: list[int], lens: list[int], tables: torch.Tensor,
                 block_size: int, dtype: torch.dtype) -> list[CompiledGroup]:
    """Groups of :data:`GROUP` decode sequences. ``rows`` index ``tables``/``lens`` and are
    sorted longest first; ``q_rows`` are their rows in the query. Padding repeats the group's
    first sequence (its output is dropped) and pads blocks with block 0 under a -inf bias."""
    device = tables.device
    groups = []
    for g in range(0, len(rows), GROUP):
        members = rows[g:g + GROUP]
        m = max(len(members), _MIN)
        n = max(-(-lens[members[0]] // block_size), _MIN)
        padded = members + members[:1] * (m - len(members))
        idx = torch.tensor(padded, device=device)
        blocks = torch.zeros(m, n, dtype=torch.int64, device=device)
        width = min(n, tables.shape[1])
        blocks[:, :width] = tables[idx, :width]
        pos = torch.arange(n * block_size, device=device).view(1, n, block_size)
        seq_lens = torch.tensor([lens[r] for r in padded], device=device)
        bias = torch.zeros(m, n, block_size, dtype=dtype, device=device)
        bias.masked_fill_(pos >= seq_lens.view(m, 1, 1), float("-inf"))
        mark_dynamic(blocks, 0, 1)
        mark_dynamic(bias, 0, 1)
        groups.append(CompiledGroup(torch.tensor([q_rows[r] for r in members], device=device),
                                    blocks, bias))
    return groups


_KERNEL = LazyCompiled(decode_math, "CPU decode attention")


def run_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              group: CompiledGroup, scale: float) -> torch.Tensor | None:
    """The group's output ``[m, Hq, D]``, or None when compiling is not possible here."""
    pad = group.blocks.shape[0] - q.shape[0]
    if pad:
        q = torch.cat([q, q[:1].expand(pad, *q.shape[1:])])
    mark_dynamic(q, 0)
    if k_cache.shape[0] >= _MIN:     # one graph whatever the pool size
        mark_dynamic(k_cache, 0)
        mark_dynamic(v_cache, 0)
    out = _KERNEL(q, k_cache, v_cache, group.blocks, group.bias, scale)
    if out is None or not pad:
        return out
    return out[:q.shape[0] - pad]
