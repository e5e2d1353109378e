"""rms_norm, fused_add_rms_norm, rotary and silu_and_mul against their references."""

from __future__ import annotations

import pytest
import torch

from tokenrelay.kernels import ops as kernels
from tokenrelay.kernels import _validate
from tokenrelay.kernels._testing import tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    monkeypatch.setattr(_validate, "POISON_OUTPUTS", True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(99)


def _randn(*shape, dtype):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def _assert_close(out, ref):
    assert not torch.isnan(out).any(), "kernel left unwritten (NaN) elements"
    torch.testing.assert_close(out.float(), ref.float(), **tolerance(ref.dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (37, 96), (5, 1000)])
def test_rms_norm(dtype, rows, hidden):
    x, w = _randn(rows, hidden, dtype=dtype), _randn(hidden, dtype=dtype)
    _assert_close(kernels.rms_norm(x, w, 1e-6), kernels.rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_add_rms_norm(dtype):
    x, w = _randn(19, 96, dtype=dtype), _randn(96, dtype=dtype)
    residual = _randn(19, 96, dtype=dtype)
    res_ref = residual.clone()
    out = kernels.fused_add_rms_norm(x, residual, w, 1e-5)
    ref = kernels.fused_add_rms_norm_ref(x, res_ref, w, 1e-5)
    _assert_close(out, ref)
    _assert_close(residual, res_ref)


def test_rms_norm_strided_rows():
    """A row-strided view (e.g. a slice of a wider buffer) is accepted and read correctly."""
    wide = _randn(7, 160, dtype=torch.float32)
    x, w = wide[:, :96], _randn(96, dtype=torch.float32)
    _assert_close(kernels.rms_norm(x, w, 1e-6), kernels.rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rot_dim", [32, 16], ids=["full", "partial"])
def test_rotary(dtype, is_neox, rot_dim):
    tokens, heads, kv_heads, dim, max_pos = 11, 6, 2, 32, 64
    qkv = _randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype)   # views of a fused projection
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    positions = torch.randint(0, max_pos, (tokens,), device=DEVICE)
    cache = _randn(max_pos, rot_dim, dtype=dtype)
    q_ref, k_ref, v_before = q.clone(), k.clone(), qkv[:, (heads + kv_heads) * dim :].clone()
    kernels.rotary(q, k, positions, cache, is_neox)
    kernels.rotary_ref(q_ref, k_ref, positions, cache, is_neox)
    _assert_close(q, q_ref)
    _assert_close(k, k_ref)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # neighbours untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,inter", [(1, 16), (33, 200), (3, 1500)])
def test_silu_and_mul(dtype, rows, inter):
    x = _randn(rows, 2 * inter, dtype=dtype) * 4
    _assert_close(kernels.silu_and_mul(x), kernels.silu_and_mul_ref(x))
