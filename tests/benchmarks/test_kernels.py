"""The benchmark's correctness part at small sizes (the same code path the GPU run takes)."""

from __future__ import annotations

from benchmarks import kernels as bench


def test_bench_check_only_small_passes(capsys):
    assert bench.main(["--check-only", "--small"]) == 0
    out = capsys.readouterr().out
    for name in ("store_kv", "paged_decode_attention", "paged_prefill_attention", "rms_norm",
                 "fused_add_rms_norm", "rotary", "silu_and_mul"):
        assert name in out
    assert " NO" not in out


def test_roofline_targets_read_the_case():
    from benchmarks.kernel_roofline import target_of

    assert target_of("paged_decode_attention", "batch 1 ctx 4096", 0.019, 0.05) == ("<= 20 us", True)
    assert target_of("paged_decode_attention", "batch 1 ctx 4096", 0.069, 0.9)[1] is False
    assert target_of("paged_decode_attention", "batch 8 ctx 4096", 1.0, 0.86) == (">= 85% of copy", True)
    assert target_of("paged_decode_attention", "batch 64 ctx 4096", 1.0, 0.68)[1] is False
    assert target_of("paged_decode_attention", "batch 3 ctx 40", 1.0, 0.1) == ("none", None)
    assert target_of("paged_prefill_attention", "spans", 1.0, 0.79) == (">= 0.8x SDPA", False)
    assert target_of("rms_norm", "2048x4096", 1.0, 0.7) == (">= 70% of copy", True)


def test_roofline_runs_every_kernel_on_cpu_at_tiny_sizes():
    """The GPU check's dry run, section alone: one row per case, prefill against SDPA."""
    from benchmarks.kernel_roofline import run

    result = run(dry=True, device="cpu")
    kernels = [r["kernel"] for r in result["rows"]]
    assert sorted(set(kernels)) == sorted(["store_kv", "paged_decode_attention",
                                           "paged_prefill_attention", "rms_norm",
                                           "fused_add_rms_norm", "rotary", "silu_and_mul"])
    prefill = next(r for r in result["rows"] if r["kernel"] == "paged_prefill_attention")
    assert prefill["unit"] == "TFLOP/s" and prefill["of_roofline"] > 0
    assert prefill["of_same_copy"] is None
    assert all(r["of_same_copy"] > 0 for r in result["rows"] if r["unit"] == "GB/s")
    assert all(r["ms"] > 0 and r["syncs"] == "n/a" for r in result["rows"])
    assert result["sweep"] and result["prefill_sweep"] and result["pointwise_sweep"]
    assert result["notes"]["sdpa_backend"] == "default"
    assert len({s["config"] for s in result["sweep"]}) == 3
    fused = [s for s in result["sweep"] if "same_bits" in s]
    assert fused and all(s["config"].startswith("fused merge") for s in fused)
    assert all(s["same_bits"] and s["counters_zero"] and s["syncs"] == "n/a" for s in fused)
    assert {s["kernel"] for s in result["pointwise_sweep"]} == {
        "store_kv", "rms_norm", "fused_add_rms_norm", "rotary"}
    assert not any(s["error"] for s in
                   result["sweep"] + result["prefill_sweep"] + result["pointwise_sweep"])
    assert any("decode sweep" in line for line in result["lines"])


def test_the_sdpa_prefill_baseline_computes_what_the_kernel_does():
    """The prefill row compares like with like: SDPA on the dense per-sequence inputs, causal to
    the lower right, gives the kernel's output."""
    import torch
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from benchmarks.kernel_cases import all_cases
    from benchmarks.kernel_roofline import _dense_prefill

    torch.manual_seed(0)
    case = next(c for c in all_cases(True, torch.float32, "cpu")
                if c.kernel == "paged_prefill_attention")
    kernel, _ = case.fns()
    out, cu = kernel(*case.args), case.args[5].tolist()
    for b, (q, k, v) in enumerate(_dense_prefill(case, "cpu")):
        dense = sdpa(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]),
                     scale=case.args[6])
        torch.testing.assert_close(dense[0].transpose(0, 1), out[cu[b]:cu[b + 1]])


def test_every_sweep_config_names_constants_the_kernels_have():
    """The GPU run tries configs the CPU dry run skips: a misspelt constant would only show
    there (as a new attribute the kernel never reads)."""
    from benchmarks.kernel_roofline import POINTWISE_SWEEP, PREFILL_SWEEP, SWEEP
    from tokenrelay.kernels import decode_attention, norm, prefill_attention, rotary, store_kv

    for _, consts, _, split in SWEEP:
        assert all(hasattr(decode_attention, name) for name in consts) and split % 64 == 0
        assert "FUSED_MERGE" in consts        # explicit: a row never follows the module default
    for _, consts, _ in PREFILL_SWEEP:
        assert all(hasattr(prefill_attention, name) for name in consts)
    modules = {"store_kv": store_kv, "norm": norm, "rotary": rotary}
    for name in POINTWISE_SWEEP:
        assert hasattr(modules[name], "ELEMS_PER_PROGRAM") and hasattr(modules[name], "NUM_WARPS")


def test_the_dry_run_decode_case_takes_the_split_path():
    """The dry run's decode case must span more than one 64-token split, or the sweep's
    fused-merge row (and every split row) would only run the direct store."""
    import torch

    from benchmarks.kernel_cases import all_cases
    from benchmarks.kernel_roofline import DRY_SWEEP

    case = next(c for c in all_cases(True, torch.float32, "cpu")
                if c.kernel == "paged_decode_attention")
    table, page = case.args[3], case.args[1].shape[1]
    assert {split for *_, split in DRY_SWEEP} == {64} and table.shape[1] * page > 64
    assert int(case.args[4].max()) > 64


def test_fused_rows_report_their_checks():
    from benchmarks.kernel_roofline import _fused_note

    assert _fused_note({"config": "default"}) == ""
    note = _fused_note({"same_bits": True, "counters_zero": False, "syncs": "none"})
    assert note == " bits = two-kernel: yes; counters 0: NO; syncs: none"
