"""The parallel-layer seam: the decoder asks these factories for its projections and embedding.

With no group (``tensor_parallel_size == 1``) each factory returns exactly the plain layer the
decoder always used, so a single-device engine runs no collective and no extra op. With a group:

- column-parallel (QKV, gate/up): a plain :class:`Linear` whose output rows are this rank's
  heads or MLP columns; its output stays split, nothing is communicated;
- row-parallel (o_proj, down_proj): input columns split, each rank's partial product summed by
  one all-reduce; the bias (o_proj under ``attention_bias``) lives on rank 0 only, so it is
  added once;
- vocab-parallel embedding: each rank holds a contiguous block of rows, looks up the ids that
  fall in it (zeros elsewhere), one all-reduce assembles the embeddings;
- vocab-parallel LM head: each rank's logits of its rows, gathered to rank 0 side by side where
  the sampler runs; padded rows are cut off there (:meth:`ParallelGroup.gather_vocab`).

Which slice of each checkpoint tensor a rank reads is :func:`checkpoint_slice`'s answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenrelay.engine.layers.linear import Linear
from tokenrelay.engine.parallel.group import ParallelGroup
from tokenrelay.engine.parallel.partition import Partition


class RowParallelLinear(Linear):
    """``in_features`` split over the ranks; the output is complete after one all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str, group: ParallelGroup) -> None:
        super().__init__(in_features, out_features, bias and group.rank == 0, dtype, device)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


def row_parallel(in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device | str, group: Optional[ParallelGroup]) -> Linear:
    """A row-parallel projection (``in_features`` is this rank's share), or the plain one."""
    if group is None:
        return Linear(in_features, out_features, bias, dtype, device)
    return RowParallelLinear(in_features, out_features, bias, dtype, device, group)


class VocabParallelEmbedding(nn.Module):
    """Rows ``[start, start + rows)`` of the embedding on this rank; the last rank's rows past
    the vocabulary are zero padding."""

    def __init__(self, part: Partition, hidden_size: int, dtype: torch.dtype,
                 device: torch.device | str, group: ParallelGroup) -> None:
        super().__init__()
        # Zeros: the padding rows are never written by the loader.
        self.weight = nn.Parameter(torch.zeros(part.vocab_per_rank, hidden_size, dtype=dtype,
                                               device=device), requires_grad=False)
        self.start, self.stop = part.vocab_rows
        self.group = group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (input_ids < self.start) | (input_ids >= self.stop)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.group.all_reduce(out)


def vocab_embedding(part: Partition, hidden_size: int, dtype: torch.dtype,
                    device: torch.device | str, group: Optional[ParallelGroup]) -> nn.Module:
    """The vocab-parallel embedding, or the plain ``nn.Embedding`` at size 1."""
    if group is None:
        emb = nn.Embedding(part.vocab_size, hidden_size, dtype=dtype, device=device,
                           _weight=torch.empty(part.vocab_size, hidden_size, dtype=dtype,
                                               device=device))
        emb.weight.requires_grad_(False)
        return emb
    return VocabParallelEmbedding(part, hidden_size, dtype, device, group)


@dataclass(frozen=True)
class Slice:
    """Rows (``dim`` 0) or columns (``dim`` 1) ``[start, stop)`` of a checkpoint tensor;
    ``padded``: the parameter has more rows than the slice (vocabulary padding, left zero)."""

    dim: int
    start: int
    stop: int
    padded: bool = False


SKIP = "skip"       # the tensor belongs to another rank only (a row-parallel bias)
_COLUMN = {0: "q_rows", 1: "kv_rows", 2: "kv_rows"}     # qkv_proj shards


def checkpoint_slice(name: str, shard: Optional[int], part: Partition
                     ) -> Optional[Slice] | str:
    """What rank ``part.rank`` reads of the checkpoint tensor that fills our parameter
    ``name`` (``shard``: its part of a fused qkv/gate_up parameter): a :class:`Slice`, None for
    the whole tensor (norms, and everything at size 1), or :data:`SKIP`."""
    if part.size == 1:
        return None
    module, kind = name.rsplit(".", 2)[-2:]
    if module == "qkv_proj":
        return Slice(0, *getattr(part, _COLUMN[shard]))
    if module == "gate_up_proj":
        return Slice(0, *part.mlp_rows)
    if module in ("o_proj", "down_proj"):
        if kind == "bias":
            return None if part.rank == 0 else SKIP
        return Slice(1, *(part.q_rows if module == "o_proj" else part.mlp_rows))
    if module in ("embed_tokens", "lm_head"):
        return Slice(0, *part.vocab_rows, padded=True)
    return None
