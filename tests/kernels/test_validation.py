"""Launchers reject bad inputs with ValueError before any kernel runs.

An out-of-bounds index would corrupt memory on the GPU (and kill the interpreter), so each bound in
the contract is checked here: slots, block-table entries, seq_lens vs table width, cu_seqlens.
Checks of index *values* run per call only under the debug flag (TOKENRELAY_KERNEL_CHECKS=1),
which this module turns on; the engine checks them once per step on the host (check_step_values).
"""

from __future__ import annotations

import pytest
import torch

from tokenrelay.kernels import _validate
from tokenrelay.kernels import ops as kernels
from tokenrelay.kernels._testing import make_case

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _debug_value_checks(monkeypatch):
    monkeypatch.setattr(_validate, "DEBUG_VALUE_CHECKS", True)


@pytest.fixture
def case():
    torch.manual_seed(0)
    return make_case([5, 20], [5, 3], 4, 2, 16, block_size=8, device=DEVICE)


@pytest.fixture
def dcase():
    torch.manual_seed(0)
    return make_case([5, 20], None, 4, 2, 16, block_size=8, device=DEVICE)


def _decode(c, **over):
    args = dict(query=c.query, k_cache=c.k_cache, v_cache=c.v_cache, block_tables=c.block_tables,
                seq_lens=c.seq_lens, scale=c.scale)
    args.update(over)
    return kernels.paged_decode_attention(**args)


def _prefill(c, **over):
    args = dict(query=c.query, k_cache=c.k_cache, v_cache=c.v_cache, block_tables=c.block_tables,
                seq_lens=c.seq_lens, cu_seqlens_q=c.cu_seqlens_q, scale=c.scale)
    args.update(over)
    return kernels.paged_prefill_attention(**args)


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def test_store_kv_rejects_bad_slots_and_shapes():
    k_cache = torch.randn(3, 4, 2, 8, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    key, value = torch.randn(2, 2, 8, device=DEVICE), torch.randn(2, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping has value 12 >= 12"):
        kernels.store_kv(key, value, k_cache, v_cache, _i32(0, 12))
    with pytest.raises(ValueError, match="slot_mapping has value -2"):
        kernels.store_kv(key, value, k_cache, v_cache, _i32(-2, 1))
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        kernels.store_kv(key, value, k_cache, v_cache, _i32(0))
    with pytest.raises(ValueError, match="key must have shape"):
        kernels.store_kv(torch.randn(2, 3, 8, device=DEVICE), value, k_cache, v_cache, _i32(0, 1))
    with pytest.raises(ValueError, match="share one dtype"):
        kernels.store_kv(key.half(), value.half(), k_cache, v_cache, _i32(0, 1))
    with pytest.raises(ValueError, match="k_cache must be contiguous"):
        kernels.store_kv(key, value, k_cache.transpose(0, 1), v_cache.transpose(0, 1), _i32(0, 1))
    with pytest.raises(ValueError, match="contiguous past dim 0"):
        kernels.store_kv(key.transpose(1, 2).contiguous().transpose(1, 2), value, k_cache, v_cache, _i32(0, 1))
    with pytest.raises(ValueError, match="slot_mapping dtype"):
        kernels.store_kv(key, value, k_cache, v_cache, torch.tensor([0.0, 1.0], device=DEVICE))


def test_decode_rejects_bad_inputs(dcase):
    c = dcase
    bad_table = c.block_tables.clone()
    bad_table[1, 1] = c.k_cache.shape[0]          # a used entry (seq 1 spans 3 pages of 8)
    with pytest.raises(ValueError, match="block_tables has value"):
        _decode(c, block_tables=bad_table)
    with pytest.raises(ValueError, match="block_tables has value -1"):
        _decode(c, block_tables=torch.where(bad_table == c.k_cache.shape[0], -1, bad_table))
    width = c.block_tables.shape[1] * 8
    with pytest.raises(ValueError, match=f"seq_lens has value {width + 1}"):
        _decode(c, seq_lens=_i32(5, width + 1))
    with pytest.raises(ValueError, match="seq_lens has value -1"):
        _decode(c, seq_lens=_i32(-1, 5))
    with pytest.raises(ValueError, match="block_tables dtype"):
        _decode(c, block_tables=c.block_tables.long())
    with pytest.raises(ValueError, match="seq_lens dtype"):
        _decode(c, seq_lens=c.seq_lens.long())
    with pytest.raises(ValueError, match="not a multiple of KV heads"):
        _decode(c, query=torch.randn(2, 3, 16, device=DEVICE))
    with pytest.raises(ValueError, match="head_dim"):
        _decode(c, query=torch.randn(2, 4, 32, device=DEVICE))
    with pytest.raises(ValueError, match="disagree with batch"):
        _decode(c, seq_lens=_i32(5))
    with pytest.raises(ValueError, match="num_splits"):
        _decode(c, num_splits=0)
    with pytest.raises(ValueError, match="share one dtype"):
        _decode(c, query=c.query.half())


def test_decode_ignores_garbage_in_unused_table_entries(dcase):
    c = dcase
    table = c.block_tables.clone()
    table[0, 1:] = 10 ** 6                          # seq 0 has 5 tokens: only entry 0 is used
    out = _decode(c, block_tables=table)
    torch.testing.assert_close(out, kernels.paged_decode_attention_ref(
        c.query, c.k_cache, c.v_cache, table, c.seq_lens, c.scale), rtol=1e-5, atol=1e-5)


def test_prefill_rejects_bad_cu_seqlens(case):
    c = case
    with pytest.raises(ValueError, match="from 0 to num_tokens = 8"):
        _prefill(c, cu_seqlens_q=_i32(0, 5, 7))
    with pytest.raises(ValueError, match="from 0 to num_tokens"):
        _prefill(c, cu_seqlens_q=_i32(1, 5, 8))
    with pytest.raises(ValueError, match="decreases at sequence 0"):
        _prefill(c, cu_seqlens_q=_i32(0, -1, 8), seq_lens=_i32(5, 20))
    with pytest.raises(ValueError, match="sequence 0 has 6 new tokens but seq_len 5"):
        _prefill(c, cu_seqlens_q=_i32(0, 6, 8))
    with pytest.raises(ValueError, match="disagree on the batch"):
        _prefill(c, cu_seqlens_q=_i32(0, 8))
    with pytest.raises(ValueError, match="cu_seqlens_q dtype"):
        _prefill(c, cu_seqlens_q=c.cu_seqlens_q.long())
    bad_table = c.block_tables.clone()
    bad_table[0, 0] = c.k_cache.shape[0] + 5
    with pytest.raises(ValueError, match="block_tables has value"):
        _prefill(c, block_tables=bad_table)


def test_pointwise_launchers_reject_bad_inputs():
    x = torch.randn(3, 16, device=DEVICE)
    with pytest.raises(ValueError, match="weight must have shape"):
        kernels.rms_norm(x, torch.randn(15, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual must have shape"):
        kernels.fused_add_rms_norm(x, torch.randn(2, 16, device=DEVICE), torch.randn(16, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="x must have 2 dims"):
        kernels.rms_norm(x[None], torch.randn(16, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="must be even"):
        kernels.silu_and_mul(torch.randn(3, 7, device=DEVICE))
    with pytest.raises(ValueError, match="dtype"):
        kernels.silu_and_mul(torch.ones(3, 8, dtype=torch.int32, device=DEVICE))
    q, k = torch.randn(4, 2, 16, device=DEVICE), torch.randn(4, 1, 16, device=DEVICE)
    cache = torch.randn(10, 16, device=DEVICE)
    with pytest.raises(ValueError, match="positions has value 10 >= 10"):
        kernels.rotary(q, k, torch.tensor([0, 1, 2, 10], device=DEVICE), cache, True)
    with pytest.raises(ValueError, match="positions has value -1"):
        kernels.rotary(q, k, torch.tensor([0, -1, 2, 3], device=DEVICE), cache, True)
    with pytest.raises(ValueError, match="cos_sin_cache width"):
        kernels.rotary(q, k, torch.tensor([0, 1, 2, 3], device=DEVICE), torch.randn(10, 18, device=DEVICE), True)
    with pytest.raises(ValueError, match="k shape"):
        kernels.rotary(q, k[:3], torch.tensor([0, 1, 2, 3], device=DEVICE), cache, True)
