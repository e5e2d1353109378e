"""The prepared step, from rank 0 to every other rank, as two tensors: never pickled objects.

Per step rank 0 broadcasts a fixed-layout int64 *header* (what follows and how long each part
is), then one int64 *payload* holding every input tensor back to back: token ids, positions,
slot mapping, block tables, sequence and context lengths, query offsets, the rows whose logits
are computed, and the copy-on-write block copies. Another rank rebuilds the same
:class:`~engine.step_inputs.StepInputs` from them and plans the step's attention itself (the
plan is a function of those tensors). (A rank's loop ends with rank 0's process or its
``shutdown``, through the rank's lifeline: no message is needed, none can hang.)

Both go over the group's control channel (gloo, host tensors), where a rank waits for as long
as the engine is idle.
"""

from __future__ import annotations

import torch

from tokenrelay.engine.parallel.group import ParallelGroup
from tokenrelay.engine.step_inputs import StepInputs

STEP = 1          # the header's kind: a step (the only kind so far)
# Header layout: one int64 each.
_KIND, _TOKENS, _SEQS, _BLOCKS, _LOGITS, _COPIES, _MAX_Q, _MAX_K, _DECODE = range(9)
HEADER_LEN = 9


def _header(step: StepInputs) -> torch.Tensor:
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[_KIND] = STEP
    h[_TOKENS] = step.input_ids.shape[0]
    h[_SEQS], h[_BLOCKS] = step.block_tables.shape
    h[_LOGITS] = step.logits_indices.shape[0]
    h[_COPIES] = step.block_copies.shape[0]
    h[_MAX_Q], h[_MAX_K] = step.max_seqlen_q, step.max_seqlen_k
    h[_DECODE] = int(step.is_decode)
    return h


def pack(step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of one step."""
    parts = [step.input_ids, step.positions, step.slot_mapping, step.block_tables.reshape(-1),
             step.seq_lens, step.context_lens, step.cu_seqlens_q, step.logits_indices,
             step.block_copies.reshape(-1)]
    payload = torch.cat([p.to(torch.int64) for p in parts])
    return _header(step), payload


def payload_len(header: torch.Tensor) -> int:
    h = header.tolist()
    return (3 * h[_TOKENS] + h[_SEQS] * h[_BLOCKS] + 3 * h[_SEQS] + 1 + h[_LOGITS]
            + 2 * h[_COPIES])


def unpack(header: torch.Tensor, payload: torch.Tensor) -> StepInputs:
    """The step ``pack`` made the header and payload of."""
    h = header.tolist()
    t, s, b = h[_TOKENS], h[_SEQS], h[_BLOCKS]
    sizes = [t, t, t, s * b, s, s, s + 1, h[_LOGITS], 2 * h[_COPIES]]
    ids, pos, slots, tables, lens, ctx, cu, logits, copies = payload.split(sizes)
    i32 = torch.int32
    return StepInputs(
        input_ids=ids, positions=pos, slot_mapping=slots,
        block_tables=tables.reshape(s, b).to(i32), seq_lens=lens.to(i32),
        context_lens=ctx.to(i32), cu_seqlens_q=cu.to(i32), logits_indices=logits,
        block_copies=copies.reshape(-1, 2), max_seqlen_q=h[_MAX_Q], max_seqlen_k=h[_MAX_K],
        is_decode=bool(h[_DECODE]))


def send_step(group: ParallelGroup, step: StepInputs) -> None:
    """Rank 0: the step to every other rank (before running it itself)."""
    header, payload = pack(step)
    group.broadcast_control(header)
    group.broadcast_control(payload)


def receive_step(group: ParallelGroup) -> StepInputs:
    """Another rank: wait for rank 0's next step."""
    header = group.broadcast_control(torch.zeros(HEADER_LEN, dtype=torch.int64))
    if int(header[_KIND]) != STEP:
        raise RuntimeError(f"step header of unknown kind {int(header[_KIND])}: rank 0 runs "
                           f"another version of engine/parallel/step.py")
    payload = torch.empty(payload_len(header), dtype=torch.int64)
    return unpack(header, group.broadcast_control(payload))
