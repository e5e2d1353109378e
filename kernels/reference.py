"""Plain-torch references for every kernel, with the kernels' exact signatures.

Why they exist: each Triton kernel is tested against these, and the engine's torch backend can be
checked against them too. They favour obviousness over speed: fp32 accumulation, one Python
iteration per sequence, no clever indexing. Outputs are cast back to the input dtype once, at the
end, exactly as the kernels do.
"""

from __future__ import annotations

import torch


def store_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token t's K/V into slot slot_mapping[t] (block = slot // block_size); skip slot -1."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        k_cache[block, offset] = key[t]
        v_cache[block, offset] = value[t]


def gather_kv_ref(
    cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """Contiguous [seq_len, Hkv, D] view of one sequence's paged context (a copy)."""
    block_size = cache.shape[1]
    num_pages = (seq_len + block_size - 1) // block_size
    pages = cache[block_table_row[:num_pages].long()]
    return pages.reshape(-1, cache.shape[2], cache.shape[3])[:seq_len]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, context_len: int) -> torch.Tensor:
    """Causal attention of q [Q, Hq, D] over k, v [S, Hkv, D] in fp32, query i seeing keys <= context_len + i."""
    num_q, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    key_pos = torch.arange(k.shape[0], device=q.device)
    limit = context_len + torch.arange(num_q, device=q.device)
    scores = scores.masked_fill(key_pos[None, None, :] > limit[None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_decode_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """One query token per sequence attending to its whole paged context (num_splits is ignored)."""
    del num_splits  # a tiling choice of the kernel; the result does not depend on it
    out = torch.zeros_like(query)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        k = gather_kv_ref(k_cache, block_tables[b], seq_len)
        v = gather_kv_ref(v_cache, block_tables[b], seq_len)
        out[b] = _attend(query[b : b + 1], k, v, scale, seq_len - 1)[0].to(query.dtype)
    return out


def paged_prefill_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Ragged causal attention: sequence b's queries are rows cu[b]:cu[b+1], its keys all cached."""
    out = torch.zeros_like(query)
    cu = cu_seqlens_q.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = cu[b], cu[b + 1]
        if end == start:
            continue
        k = gather_kv_ref(k_cache, block_tables[b], seq_len)
        v = gather_kv_ref(v_cache, block_tables[b], seq_len)
        context_len = seq_len - (end - start)
        out[start:end] = _attend(query[start:end], k, v, scale, context_len).to(query.dtype)
    return out


def _rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    inv = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return xf * inv * weight.float()


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, all in fp32, cast once."""
    return _rms_norm_fp32(x, weight, eps).to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x in place (rounded to residual's dtype), then rms_norm of the stored residual."""
    summed = (residual.float() + x.float()).to(residual.dtype)
    residual.copy_(summed)
    return _rms_norm_fp32(summed, weight, eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotate the first 2*cos.shape[-1] dims of x [T, H, D] in fp32; the rest pass through."""
    half = cos.shape[-1]
    xf = x.float()
    rot = xf[..., : 2 * half]
    if is_neox:
        x1, x2 = rot[..., :half], rot[..., half:]
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    if is_neox:
        rotated = torch.cat([o1, o2], dim=-1)
    else:
        rotated = torch.stack([o1, o2], dim=-1).flatten(-2)
    return torch.cat([rotated, xf[..., 2 * half :]], dim=-1).to(x.dtype)


def rotary_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """In-place rotary embedding of q and k at positions; cache row = cos half | sin half."""
    half = cos_sin_cache.shape[1] // 2
    rows = cos_sin_cache[positions.long()].float()
    cos, sin = rows[:, :half], rows[:, half:]
    q.copy_(_rotate(q, cos, sin, is_neox))
    k.copy_(_rotate(k, cos, sin, is_neox))


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :I]) * x[:, I:] in fp32, cast once."""
    inter = x.shape[-1] // 2
    gate, up = x[..., :inter].float(), x[..., inter:].float()
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
