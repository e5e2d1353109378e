"""Paged attention, torch backend: metadata, KV store and attention reading from the paged cache.

The cache of a layer is ``k_cache, v_cache: [num_blocks, block_size, Hkv, D]``. Instead of
looping over sequences, both prefill and decode gather each sequence's blocks with one index op
into a padded ``[B, L, Hkv, D]`` view, pad the ragged queries into ``[B, Lq, Hq, D]`` and run
one ``scaled_dot_product_attention`` with an explicit boolean mask. GQA is handled by folding the
query-head group into the query length (``[B, Hkv, G*Lq, D]``), so K/V are never repeated.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step batch layout shared by every layer (see docs/contracts.md)."""

    slot_mapping: torch.Tensor      # [T] int64, cache slot of each new token (-1 = do not store)
    block_tables: torch.Tensor      # [B, max_blocks] int32, physical block ids, padded with 0
    seq_lens: torch.Tensor          # [B] int32, context length per sequence INCLUDING new tokens
    context_lens: torch.Tensor      # [B] int32, tokens already cached before this step
    cu_seqlens_q: torch.Tensor      # [B+1] int32, prefix sums of new-token counts per sequence
    max_seqlen_q: int
    max_seqlen_k: int
    is_decode: bool                 # every sequence has exactly one new token


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key/value[T, Hkv, D]`` into the flat slots ``slot_mapping[T]``; -1 skips a token."""
    num_blocks, block_size, hkv, d = k_cache.shape
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    k_cache.view(num_blocks * block_size, hkv, d).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(num_blocks * block_size, hkv, d).index_copy_(0, slots, value.to(v_cache.dtype))


class _Workspace(threading.local):
    """Reused gather buffers. A fresh multi-MB tensor per layer per step costs more in page
    faults than the copy itself on CPU (measured ~5x), so K and V gathers write into buffers
    that only grow. Thread-local, so two engines on two threads never share a buffer."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype, torch.device, bool], torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # Inference tensors cannot be written outside inference mode (and vice versa for
        # autograd), so each mode gets its own buffers.
        key = (name, dtype, device, torch.is_inference_mode_enabled())
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[key] = buf
        return buf[:numel]


_WORKSPACE = _Workspace()


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int,
               name: str) -> torch.Tensor:
    """``[B, num_blocks*block_size, Hkv, D]``: each sequence's first ``num_blocks`` blocks."""
    _, block_size, hkv, d = cache.shape
    tables = block_tables[:, :num_blocks].reshape(-1).long()
    b = block_tables.shape[0]
    if cache.device.type != "cpu":
        return cache.index_select(0, tables).view(b, num_blocks * block_size, hkv, d)
    numel = tables.numel() * block_size * hkv * d
    out = _WORKSPACE.get(name, numel, cache.dtype, cache.device).view(-1, block_size, hkv, d)
    # index_select on the flat table is markedly faster on CPU than advanced indexing.
    torch.index_select(cache, 0, tables, out=out)
    return out.view(b, num_blocks * block_size, hkv, d)


def _padded_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      q_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention for padded queries ``q[B, Lq, Hq, D]``: sequence b's new tokens are its first
    ``q_lens[b]`` rows (rest padding); returns ``[B, Lq, Hq, D]`` (padding rows are garbage).

    Query i of sequence b sits at position ``seq_len - q_len + i`` and sees keys ``<= `` it.
    """
    b, lq, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    block_size = k_cache.shape[1]
    max_len = int(seq_lens.max())
    nblk = (max_len + block_size - 1) // block_size
    k = _gather_kv(k_cache, block_tables, nblk, "k").transpose(1, 2)   # [B, Hkv, L, D]
    v = _gather_kv(v_cache, block_tables, nblk, "v").transpose(1, 2)
    seq = seq_lens.long()
    ctx = seq - q_lens.long()                                      # [B]
    q_pos = ctx[:, None] + torch.arange(lq, device=q.device)[None, :]   # [B, Lq]
    k_idx = torch.arange(k.shape[2], device=q.device)
    mask = k_idx[None, None, :] <= q_pos[:, :, None]               # [B, Lq, L]
    mask &= k_idx[None, None, :] < seq[:, None, None]
    # Padding query rows (i >= q_len) see key 0 only so SDPA never gets an all-masked row.
    mask[:, :, 0] = True
    # Fold the GQA group into the query length: [B, Lq, Hkv, G, D] -> [B, Hkv, G*Lq, D].
    qg = q.view(b, lq, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, group * lq, d)
    mask = mask[:, None, None].expand(b, 1, group, lq, k.shape[2]).reshape(b, 1, group * lq, -1)
    out = F.scaled_dot_product_attention(qg, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                         scale=scale)
    return out.view(b, hkv, group, lq, d).permute(0, 3, 1, 2, 4).reshape(b, lq, hq, d)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           num_splits: int | None = None) -> torch.Tensor:
    """One new query per sequence, ``query[B, Hq, D]`` -> ``[B, Hq, D]``; ``num_splits`` is a
    kernel tuning knob and is ignored here."""
    ones = torch.ones_like(seq_lens)
    out = _padded_attention(query[:, None], k_cache, v_cache, block_tables, seq_lens, ones, scale)
    return out[:, 0]


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, scale: float) -> torch.Tensor:
    """Ragged causal attention for ``query[T, Hq, D]`` (new tokens of B sequences, concatenated)
    against the cache, which must already hold the new tokens' K/V; covers chunked prefill and
    cached prefixes (context_len = seq_len - q_len).

    Sequences with a single new token (decodes batched with a prefill chunk) take the decode
    path, so they are not padded to the chunk's length."""
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    single = q_lens == 1
    if bool(single.all()):
        return paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, scale)
    if not bool(single.any()):
        return _prefill_padded(query, k_cache, v_cache, block_tables, seq_lens, q_lens, scale)
    out = torch.empty_like(query)
    ones = single.nonzero().squeeze(1)
    rows = cu[:-1][ones]
    out[rows] = paged_decode_attention(query[rows], k_cache, v_cache, block_tables[ones],
                                       seq_lens[ones], scale)
    multi = (~single).nonzero().squeeze(1)
    m_lens = q_lens[multi]
    total = int(m_lens.sum())
    starts = torch.repeat_interleave(cu[:-1][multi], m_lens, output_size=total)
    offsets = torch.arange(total, device=query.device) - torch.repeat_interleave(
        torch.cumsum(m_lens, 0) - m_lens, m_lens, output_size=total)
    tokens = starts + offsets
    out[tokens] = _prefill_padded(query[tokens], k_cache, v_cache, block_tables[multi],
                                  seq_lens[multi], m_lens, scale)
    return out


def _prefill_padded(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Scatter ragged ``query[T]`` into ``[B, max q_len]``, attend, gather back to ``[T]``."""
    b = q_lens.shape[0]
    t, hq, d = query.shape
    lq = int(q_lens.max())
    seq_id = torch.repeat_interleave(torch.arange(b, device=query.device), q_lens, output_size=t)
    first = torch.cumsum(q_lens, 0) - q_lens
    row = torch.arange(t, device=query.device) - first[seq_id]
    padded = query.new_zeros(b, lq, hq, d)
    padded[seq_id, row] = query
    out = _padded_attention(padded, k_cache, v_cache, block_tables, seq_lens, q_lens, scale)
    return out[seq_id, row]
