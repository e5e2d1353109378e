"""benchmarks.simulated_gpu on a tiny setting: it really runs the fake engine alone and through
Redis in both worker modes, and prints a ratio and where the time goes for each."""

from __future__ import annotations

import re

import pytest

from benchmarks import simulated_gpu as bench

pytestmark = pytest.mark.timeout(180)


def test_a_tiny_run_prints_both_modes_with_measured_figures(capsys):
    assert bench.main(["--setting", "2x4", "--tokens", "6", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^2 ms x 4 \(6 tokens each\): engine alone +\d+ token events/s", out, re.M)
    for mode in bench.MODES:
        line = next(x for x in out.splitlines() if x.strip().startswith(mode))
        ratio = float(re.search(r"ratio (\d+\.\d+)", line).group(1))
        assert 0.05 < ratio < 3.0, line
        flushes = float(re.search(r"([\d.]+) flush round trips", line).group(1))
        assert flushes >= 0.5, line           # about one per step, counted by the worker
        assert re.search(r"worker CPU [\d.]+ ms, redis CPU [\d.]+ ms", line), line
        assert re.search(r"p99 [\d.]+ ms", line), line
    assert "load average:" in out


def test_the_engine_alone_counts_one_event_per_sequence_per_step():
    s = bench.Setting(step_ms=1.0, seqs=3, tokens=5)
    rate = bench.engine_alone(s, bench.workload(s, 0))
    assert 100 < rate < 3 / 0.001 * 1.2        # 3 events per >= 1 ms step
