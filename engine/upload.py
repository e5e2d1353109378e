"""A step's small index tensors to the device in one copy.

Why: a step sends about ten small host tensors (ids, positions, slot mapping, block tables,
lengths, logits rows, the overlapped core's placeholder rows). On CUDA each went through its
own pinned buffer (``pin_memory``: a caching-allocator block and a copy) and its own
non-blocking host-to-device copy (a launch and an event for the allocator), about ten times
per step on the host's launch path, which the H200 run of 2026-12-04 measured at 1.39 ms a
step at 256 sequences. Packed, they take one pinned buffer and one copy; each tensor is then
a view of the device buffer. On a CPU device nothing is copied at all.

Layout: each tensor's bytes, in order, each start aligned to ``ALIGN`` bytes so every view
has its dtype's alignment.
"""

from __future__ import annotations

from typing import Sequence

import torch

ALIGN = 8     # bytes: the widest dtype a step sends (int64)


def upload(tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` (host, any shapes and dtypes of at most ``ALIGN`` bytes) on ``device``:
    the tensors themselves on a CPU device; on CUDA views of one buffer, copied from pinned
    memory without making the host wait (the caching host allocator keeps the pinned buffer
    until the copy has run)."""
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    packed = pack(tensors).pin_memory().to(device, non_blocking=True)
    return unpack(packed, tensors)


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One uint8 host tensor holding every tensor's bytes, each start aligned to ALIGN."""
    pieces: list[torch.Tensor] = []
    for t in tensors:
        if t.element_size() > ALIGN:
            raise ValueError(f"cannot pack {t.dtype}: elements wider than {ALIGN} bytes")
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        pieces.append(raw)
        pad = -raw.numel() % ALIGN
        if pad:
            pieces.append(torch.zeros(pad, dtype=torch.uint8))
    if not pieces:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.cat(pieces)


def unpack(packed: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``packed`` (``pack(like)``, wherever it now lives) with each of ``like``'s
    shape and dtype."""
    out: list[torch.Tensor] = []
    offset = 0
    for t in like:
        n = t.numel() * t.element_size()
        out.append(packed[offset:offset + n].view(t.dtype).reshape(t.shape))
        offset += n + (-n % ALIGN)
    return out
