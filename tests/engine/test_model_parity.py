"""Our paged decoder vs transformers on the same tiny checkpoints.

Every path that reads the paged cache is compared against a full-sequence transformers forward:
whole-prompt prefill, ragged batched prefill, step-by-step decode, chunked prefill mixed with
decode, with block tables drawn from a shuffled pool so physical order never matches logical.
"""

from __future__ import annotations

import math

import pytest
import torch

from tokenrelay.engine.layers.attention import (AttentionMetadata, paged_decode_attention,
                              paged_prefill_attention, store_kv)
from tokenrelay.engine.loader import load_model
from tokenrelay.engine.layers.ops import get_ops

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
BLOCK = 4
ATOL = 1e-4


def kv_pool(model, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed ``[num_blocks, BLOCK, Hkv, D]`` (k, v) pairs, one per layer, as the model runner
    allocates them."""
    cfg = model.config
    shape = (num_blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    device = model.model.embed_tokens.weight.device
    return [(torch.zeros(shape, dtype=model.dtype, device=device),
             torch.zeros(shape, dtype=model.dtype, device=device))
            for _ in range(cfg.num_hidden_layers)]


class Paged:
    """A KV pool plus per-sequence block tables taken from a shuffled free list."""

    def __init__(self, model, num_blocks: int = 96, seed: int = 0) -> None:
        self.model = model
        self.caches = kv_pool(model, num_blocks)
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: dict[int, list[int]] = {}
        self.tokens: dict[int, list[int]] = {}

    def step(self, batch: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Feed ``new tokens`` for each ``(seq id, new tokens)``; returns logits per sequence."""
        ids, pos, slots, seq_lens, ctx_lens, cu = [], [], [], [], [], [0]
        for sid, new in batch:
            seen = self.tokens.setdefault(sid, [])
            table = self.tables.setdefault(sid, [])
            ctx = len(seen)
            while len(table) * BLOCK < ctx + len(new):
                table.append(self.free.pop())
            for i, tok in enumerate(new):
                p = ctx + i
                ids.append(tok)
                pos.append(p)
                slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
            seen.extend(new)
            seq_lens.append(ctx + len(new))
            ctx_lens.append(ctx)
            cu.append(cu[-1] + len(new))
        width = max(len(self.tables[sid]) for sid, _ in batch)
        tables = [self.tables[sid] + [0] * (width - len(self.tables[sid])) for sid, _ in batch]
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            max_seqlen_q=max(len(new) for _, new in batch),
            max_seqlen_k=max(seq_lens),
            is_decode=all(len(new) == 1 for _, new in batch),
        )
        meta.plan = self.model.ops.plan_step(meta, BLOCK, self.model.dtype)   # as the runner does
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), meta, self.caches)
            logits = self.model.compute_logits(hidden)
        return [logits[cu[i]:cu[i + 1]] for i in range(len(batch))]


_HF_CACHE: dict[tuple, object] = {}


def hf_logits(path, tokens: list[int], dtype=torch.float32) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    key = (str(path), dtype)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    with torch.no_grad():
        return _HF_CACHE[key](torch.tensor([tokens])).logits[0].float()


def prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(5, 1024, (n,), generator=gen).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_matches_transformers(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    tokens = prompt(37, seed=1)
    (ours,) = Paged(load_model(path, dtype="float32")).step([(0, tokens)])
    torch.testing.assert_close(ours, hf_logits(path, tokens), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_ragged_prefill_then_decode(tiny_checkpoint, arch):
    """Three prompts in one ragged prefill, then greedy decode steps with B=3."""
    path = tiny_checkpoint(arch)
    run = Paged(load_model(path, dtype="float32"), seed=2)
    prompts = {0: prompt(5, 3), 1: prompt(17, 4), 2: prompt(1, 5)}
    got = {sid: [lg] for sid, lg in zip(prompts, run.step(list(prompts.items())))}
    for _ in range(6):
        batch = [(sid, [int(got[sid][-1][-1].argmax())]) for sid in prompts]
        for (sid, _), lg in zip(batch, run.step(batch)):
            got[sid].append(lg)
    for sid in prompts:
        ours = torch.cat(got[sid])
        torch.testing.assert_close(ours, hf_logits(path, run.tokens[sid])[:len(ours)],
                                   atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_mixed_with_decode(tiny_checkpoint, arch):
    """A prompt prefilled in two chunks, the second one batched with another seq's decode."""
    path = tiny_checkpoint(arch)
    run = Paged(load_model(path, dtype="float32"), seed=3)
    long, short = prompt(30, 6), prompt(9, 7)
    first_long, (first_short,) = run.step([(0, long[:13])]), run.step([(1, short)])
    nxt = int(first_short[-1].argmax())
    second_long, dec_short = run.step([(0, long[13:]), (1, [nxt])])
    torch.testing.assert_close(torch.cat([first_long[0], second_long]), hf_logits(path, long),
                               atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat([first_short, dec_short]),
                               hf_logits(path, short + [nxt]), atol=ATOL, rtol=0)


@pytest.mark.parametrize("scaling", ["linear", "llama3"])
def test_rope_scaling_matches_transformers(tiny_checkpoint, scaling):
    path = tiny_checkpoint("llama", rope_scaling=scaling)
    tokens = prompt(40, seed=8)
    run = Paged(load_model(path, dtype="float32"))
    (pre,) = run.step([(0, tokens[:-3])])
    decoded = [run.step([(0, [t])])[0] for t in tokens[-3:]]
    torch.testing.assert_close(torch.cat([pre, *decoded]), hf_logits(path, tokens),
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_half_precision_roughly_matches(tiny_checkpoint, arch, dtype):
    path = tiny_checkpoint(arch)
    tokens = prompt(24, seed=9)
    model = load_model(path, dtype=dtype)
    assert model.model.embed_tokens.weight.dtype == dtype
    run = Paged(model)
    (pre,) = run.step([(0, tokens[:-2])])
    decoded = [run.step([(0, [t])])[0] for t in tokens[-2:]]
    ours = torch.cat([pre, *decoded])
    assert ours.dtype == torch.float32
    ref = hf_logits(path, tokens, dtype=dtype)
    ref32 = hf_logits(path, tokens)
    # Same dtype as transformers: close; vs float32: argmax mostly agrees.
    assert (ours - ref).abs().max() < 0.1 * ref32.abs().max()
    agree = (ours.argmax(-1) == ref32.argmax(-1)).float().mean()
    assert agree >= 0.9


def _naive_attention(q, k, v, q_start, scale):
    """One sequence, dense: q[Lq, Hq, D] at positions q_start.., k/v[L, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(q.shape[0])[:, None] + q_start
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_paged_attention_ops_match_dense_reference():
    torch.manual_seed(0)
    hq, hkv, d, nblocks = 6, 2, 16, 40
    k_cache = torch.zeros(nblocks, BLOCK, hkv, d)
    v_cache = torch.zeros_like(k_cache)
    seq_lens, q_lens = [9, 1, 14, 5], [4, 1, 14, 2]
    perm = torch.randperm(nblocks).tolist()
    tables, ks, vs, qs = [], [], [], []
    for n in seq_lens:
        table = [perm.pop() for _ in range(math.ceil(n / BLOCK))]
        tables.append(table + [0] * (4 - len(table)))
        k, v = torch.randn(n, hkv, d), torch.randn(n, hkv, d)
        slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)])
        store_kv(k, v, k_cache, v_cache, slots)
        ks.append(k)
        vs.append(v)
    qs = [torch.randn(n, hq, d) for n in q_lens]
    scale = d ** -0.5
    bt = torch.tensor(tables, dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = paged_prefill_attention(torch.cat(qs), k_cache, v_cache, bt, sl, cu, scale)
    ref = torch.cat([_naive_attention(q, k, v, n - len(q), scale)
                     for q, k, v, n in zip(qs, ks, vs, seq_lens)])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    dq = torch.randn(len(seq_lens), hq, d)
    dec = paged_decode_attention(dq, k_cache, v_cache, bt, sl, scale)
    ref = torch.cat([_naive_attention(q[None], k, v, n - 1, scale)
                     for q, k, v, n in zip(dq, ks, vs, seq_lens)])
    torch.testing.assert_close(dec, ref, atol=1e-5, rtol=1e-5)


def test_store_kv_skips_negative_slots():
    k_cache = torch.zeros(2, BLOCK, 1, 2)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, 1, 2)
    store_kv(key, key * 2, k_cache, v_cache, torch.tensor([5, -1, 0]))
    flat = k_cache.view(-1, 1, 2)[:, 0, 0]
    assert flat.tolist() == [1, 0, 0, 0, 0, 1, 0, 0]
    assert v_cache.view(-1, 1, 2)[5, 0, 0] == 2


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="torch"):
        get_ops("cuda-magic")


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_matches_complex_rotation(is_neox):
    from tokenrelay.engine.layers.torch_ops import build_cos_sin_cache, rotary

    torch.manual_seed(1)
    d = 8
    cache = build_cos_sin_cache(d, 32, 10000.0, None)
    q, k = torch.randn(5, 3, d), torch.randn(5, 1, d)
    pos = torch.tensor([0, 3, 7, 31, 2])
    angles = torch.polar(torch.ones(5, d // 2), torch.atan2(cache[pos, d // 2:], cache[pos, :d // 2]))

    def expected(x):
        pairs = (x.view(5, -1, 2, d // 2).transpose(-1, -2) if is_neox
                 else x.view(5, -1, d // 2, 2)).contiguous()
        rotated = torch.view_as_real(torch.view_as_complex(pairs) * angles[:, None])
        return rotated.transpose(-1, -2).reshape(x.shape) if is_neox else rotated.reshape(x.shape)

    want_q, want_k = expected(q), expected(k)
    rotary(q, k, pos, cache, is_neox)
    torch.testing.assert_close(q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k, want_k, atol=1e-5, rtol=1e-5)
