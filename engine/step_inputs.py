"""One step's tensors, as the step side hands them to the forward pass: imports nothing of ours.

:class:`StepInputs` is what the ModelRunner prepares on the host for a step (and what rank 0
sends every other rank of a tensor-parallel engine, engine/parallel/step.py); :class:`Placeholders`
are the input ids the host does not know yet (the overlapped core's, engine/overlap.py). Both
sides of the engine read them, so they live here, below both: the ModelRunner and the
tensor-parallel launcher and wire import this module, never each other through it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placeholders:
    """Input ids the host does not know yet: ``input_ids[dst] = source[src]`` on the device,
    ``source`` being the previous step's sampled ids, still where they were drawn."""

    dst: torch.Tensor       # [P] int64, rows of the step's input_ids
    src: torch.Tensor       # [P] int64, rows of ``source``
    source: torch.Tensor    # [S] int64


@dataclass
class StepInputs:
    """One step's inputs on the host: what rank 0 prepares and every other rank receives."""

    input_ids: torch.Tensor        # [T] int64
    positions: torch.Tensor        # [T] int64
    slot_mapping: torch.Tensor     # [T] int64
    block_tables: torch.Tensor     # [S, B] int32
    seq_lens: torch.Tensor         # [S] int32
    context_lens: torch.Tensor     # [S] int32
    cu_seqlens_q: torch.Tensor     # [S + 1] int32
    logits_indices: torch.Tensor   # [L] int64, the token rows whose logits are computed
    block_copies: torch.Tensor     # [C, 2] int64 (src, dst), copied before the forward
    max_seqlen_q: int
    max_seqlen_k: int
    is_decode: bool
