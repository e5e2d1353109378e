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


def test_bench_decode_target_reads_batch_from_the_label(capsys):
    rows = [dict(kernel="paged_decode_attention", label="batch 8 ctx 4096", ms=1.0, gbs=1.0, pct=0.2, tflops=1.0),
            dict(kernel="paged_decode_attention", label="batch 64 ctx 4096", ms=1.0, gbs=1.0, pct=0.75, tflops=1.0)]
    assert bench._print_timings(rows, 4000.0)          # batch 8 is below target but does not count
    rows[1]["pct"] = 0.5
    assert not bench._print_timings(rows, 4000.0)
    assert "NOT met" in capsys.readouterr().out
