"""The attention plan of one step: how the batch splits into decode groups and prefill sequences.

The split depends only on block tables and lengths, which every layer of a step shares, so the
ModelRunner builds one plan per step (``AttentionPlan.for_step``), stores it on the step's
:class:`~engine.layers.attention.AttentionMetadata` and every layer's attention reads it from
there. The torch attention functions (attention.py) use it; the triton kernels need none (they
read the block tables on the device). A caller that calls an attention function without a plan
(a test, a one-off) gets one built for that call.

Decode groups come in two shapes, one per decode path: gather groups for the eager path and
padded groups for the compiled kernel (compiled_decode.py). Only the path that runs asks,
and each is built at most once per step (at the first layer) and kept on the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenrelay.engine.layers import compiled_decode

# Decode sequences are attended in groups of at most this many, sorted by length: padding to the
# longest member of a group of similar lengths wastes little (one padded batch of 48 gathered ~2x
# the needed KV and took ~2x longer, measured on the bench model). Whole-workload runs with fresh
# prompts each (so the prefix cache cannot help): 8 gave 316-360 output tok/s against 280-319 for
# 16, with OpenMP threads spinning or sleeping (OMP_WAIT_POLICY=PASSIVE) alike; 4 was close to 8.
# Smaller groups keep each gathered K/V (~2.4 MB at 300 keys) nearer the cores' caches.
EAGER_DECODE_GROUP = 8


@dataclass
class DecodeGroup:
    """Decodes attended together on the eager path: one gather of their blocks, one SDPA."""

    q_rows: torch.Tensor            # [m] int64, the query rows (tokens) this group holds
    blocks: torch.Tensor            # [m * nblk] int64, their first nblk blocks, row by row
    num_keys: int                   # nblk * block_size
    mask: torch.Tensor | None       # [m, 1, 1, num_keys] additive float mask, None if all full


@dataclass
class PrefillSeq:
    """A sequence with more than one new token: its own causal SDPA."""

    start: int                      # first row of this sequence in the ragged query
    q_len: int
    seq_len: int
    blocks: torch.Tensor            # [nblk] int64


class AttentionPlan:
    """Decodes (longest first, grouped on demand) and per-sequence prefills of one step."""

    def __init__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 q_lens: list[int], block_size: int, dtype: torch.dtype) -> None:
        lens = seq_lens.tolist()
        if len(lens) != len(q_lens):
            raise ValueError(f"{len(lens)} sequence lengths for {len(q_lens)} query spans")
        starts = [0] * len(q_lens)          # first query row of each sequence
        for i in range(1, len(q_lens)):
            starts[i] = starts[i - 1] + q_lens[i - 1]
        tables = block_tables.long()
        self.block_size = block_size
        self.dtype = dtype
        self.lens, self.starts, self.tables = lens, starts, tables
        self.decodes = sorted((i for i, q in enumerate(q_lens) if q == 1), key=lambda i: -lens[i])
        self.prefills = [PrefillSeq(starts[i], q, lens[i], tables[i, :-(-lens[i] // block_size)])
                         for i, q in enumerate(q_lens) if q > 1]
        self._eager_groups: list[DecodeGroup] | None = None
        self._compiled_groups: list[compiled_decode.CompiledGroup] | None = None

    @classmethod
    def for_step(cls, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 cu_seqlens_q: torch.Tensor | None, block_size: int,
                 dtype: torch.dtype) -> "AttentionPlan":
        """The plan of a batch as the attention contract describes it; ``cu_seqlens_q=None``
        means one new token per sequence (a decode step)."""
        if cu_seqlens_q is None:
            q_lens = [1] * seq_lens.shape[0]
        else:
            cu = cu_seqlens_q.tolist()
            q_lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
        return cls(block_tables, seq_lens, q_lens, block_size, dtype)

    @property
    def num_seqs(self) -> int:
        return len(self.lens)

    def eager_groups(self) -> list[DecodeGroup]:
        """Groups of :data:`EAGER_DECODE_GROUP` decodes for gather + SDPA (built on first use)."""
        if self._eager_groups is None:
            self._eager_groups = [self._eager_group(self.decodes[g:g + EAGER_DECODE_GROUP])
                                  for g in range(0, len(self.decodes), EAGER_DECODE_GROUP)]
        return self._eager_groups

    def _eager_group(self, rows: list[int]) -> DecodeGroup:
        bs, lens, device = self.block_size, self.lens, self.tables.device
        n = -(-lens[rows[0]] // bs)
        rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
        mask = None
        if any(lens[r] != n * bs for r in rows):
            keys = torch.arange(n * bs, device=device)
            row_lens = torch.tensor([lens[r] for r in rows], device=device)
            mask = torch.zeros(len(rows), n * bs, dtype=self.dtype, device=device)
            mask.masked_fill_(keys[None, :] >= row_lens[:, None], float("-inf"))
            mask = mask[:, None, None, :]
        q_rows = torch.tensor([self.starts[r] for r in rows], dtype=torch.int64, device=device)
        return DecodeGroup(q_rows, self.tables[rows_t, :n].reshape(-1), n * bs, mask)

    def compiled_groups(self) -> list[compiled_decode.CompiledGroup]:
        """The decodes as groups for the compiled kernel (built on first use)."""
        if self._compiled_groups is None:
            self._compiled_groups = compiled_decode.build_groups(
                self.decodes, self.starts, self.lens, self.tables, self.block_size, self.dtype)
        return self._compiled_groups
