"""Packed linears on CPU (oneDNN, MKL, or the faster of them): same results as F.linear, safe
fallbacks, wired into the engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenrelay.engine.layers import cpu_gemm
from tokenrelay.engine.layers.linear import Linear
from tokenrelay.engine.llm import LLM
from tokenrelay.engine.loader import load_model
from tokenrelay.engine.sampling_params import SamplingParams

needs_packed_gemm = pytest.mark.skipif(not cpu_gemm.available(),
                                       reason="torch built without MKL or oneDNN")
BACKENDS = [b for b in cpu_gemm.BACKENDS if cpu_gemm.available(b)]


@pytest.mark.skipif(not BACKENDS, reason="no packed GEMM in this torch build")
@pytest.mark.parametrize("backend", BACKENDS + ["auto"])
@pytest.mark.parametrize("rows", [1, 3, 16, 48, 49, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_at_every_batch_size(backend: str, rows: int,
                                                             bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen)
    b = torch.randn(96, generator=gen) if bias else None
    packed = cpu_gemm.pack(weight, b, backend)
    assert packed is not None
    assert backend == "auto" or packed.backend == backend
    x = torch.randn(rows, 64, generator=gen)
    x_strided = torch.randn(rows, 128, generator=gen)[:, ::2]
    with torch.inference_mode():
        got = cpu_gemm.linear(x, packed, weight, b)
        strided = cpu_gemm.linear(x_strided, packed, weight, b)
    torch.testing.assert_close(got, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(strided, F.linear(x_strided, weight, b), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(len(BACKENDS) < 2, reason="needs both oneDNN and MKL")
def test_auto_keeps_the_faster_backend_and_remembers_it_per_shape(monkeypatch) -> None:
    """"auto" times each backend once per weight shape and keeps the faster one."""
    timed: list[str] = []

    def fake_time(packed, x, weight, bias):
        timed.append(packed.backend)
        return {"onednn": 2.0, "mkl": 1.0}[packed.backend]

    monkeypatch.setattr(cpu_gemm, "_time", fake_time)
    monkeypatch.setattr(cpu_gemm, "_CHOSEN", {})
    first = cpu_gemm.pack(torch.randn(40, 24))
    assert first is not None and first.backend == "mkl"
    assert set(timed) == {"mkl", "onednn"}
    timed.clear()
    again = cpu_gemm.pack(torch.randn(40, 24))
    assert again is not None and again.backend == "mkl" and not timed     # not re-timed
    assert cpu_gemm.pack(torch.randn(40, 24), backend="onednn").backend == "onednn"


def test_unknown_backend_is_a_clear_error(tiny_llama) -> None:
    with pytest.raises(ValueError, match="cpu GEMM backend"):
        cpu_gemm.pack(torch.randn(8, 8), backend="blis")
    with pytest.raises(ValueError, match="cpu_gemm_backend"):
        LLM(str(tiny_llama), cpu_gemm_backend="blis")


def test_pack_declines_what_it_cannot_serve() -> None:
    assert cpu_gemm.pack(torch.randn(8, 8, dtype=torch.float16)) is None
    assert cpu_gemm.pack(torch.randn(8, 8, dtype=torch.bfloat16)) is None
    assert cpu_gemm.pack(torch.randn(8, 8).t()) is None      # not contiguous
    assert cpu_gemm.pack(torch.randn(8)) is None


@needs_packed_gemm
def test_pack_is_refused_when_it_does_not_reproduce_f_linear(monkeypatch) -> None:
    """The layout check is what guards a different library: a wrong result means no pack."""
    real = cpu_gemm.linear
    monkeypatch.setattr(cpu_gemm, "linear",
                        lambda x, p, w, b: real(x, p, w, b) * (1.0 if x.shape[0] != 7 else 1.01))
    monkeypatch.setattr(cpu_gemm, "_CHOSEN", {})
    assert cpu_gemm.pack(torch.randn(32, 16)) is None
    for backend in BACKENDS:
        assert cpu_gemm.pack(torch.randn(32, 16), backend=backend) is None
    layer = Linear(16, 32, False, torch.float32, "cpu")
    layer.weight.data.normal_()
    assert layer.prepack() is False and layer.packed is None
    x = torch.randn(5, 16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


@needs_packed_gemm
def test_prepacked_model_gives_the_same_logits(tiny_qwen2) -> None:
    """Every projection (QKV bias included) and the LM head, packed vs plain."""
    plain = load_model(tiny_qwen2, dtype="float32")
    packed = load_model(tiny_qwen2, dtype="float32")
    assert packed.prepack_cpu_weights() == 4 * len(packed.model.layers) + 1
    hidden = torch.randn(11, plain.config.hidden_size)
    with torch.inference_mode():
        torch.testing.assert_close(packed.compute_logits(hidden), plain.compute_logits(hidden),
                                   rtol=1e-5, atol=1e-5)
        layer_p, layer_q = packed.model.layers[0], plain.model.layers[0]
        torch.testing.assert_close(layer_p.self_attn.qkv_proj(hidden),
                                   layer_q.self_attn.qkv_proj(hidden), rtol=1e-5, atol=1e-5)


@needs_packed_gemm
def test_engine_packs_on_cpu_unless_told_not_to(tiny_llama) -> None:
    prompts = ["The quick brown fox", "Once upon a time there was"]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    on = LLM(str(tiny_llama), dtype="float32")
    off = LLM(str(tiny_llama), dtype="float32", cpu_prepack_weights=False)
    model_on = on.engine.model_runner.model
    model_off = off.engine.model_runner.model
    assert model_on.lm_head_packed is not None
    assert model_off.lm_head_packed is None
    assert all(m.packed is None for m in model_off.modules() if isinstance(m, Linear))
    got = [o.outputs[0].token_ids for o in on.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in off.generate(prompts, params)]
    assert got == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_uses_the_backend_it_is_told_to(tiny_llama, backend: str) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", cpu_gemm_backend=backend)
    model = llm.engine.model_runner.model
    packs = [m.packed for m in model.modules() if isinstance(m, Linear) and m.packed is not None]
    packs.append(model.lm_head_packed)
    assert len(packs) > 1 and {p.backend for p in packs} == {backend}
    plain = LLM(str(tiny_llama), dtype="float32", cpu_prepack_weights=False)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    prompts = ["The quick brown fox", "Once upon a time there was"]
    assert ([o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            == [o.outputs[0].token_ids for o in plain.generate(prompts, params)])
