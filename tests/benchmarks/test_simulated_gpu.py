"""benchmarks.simulated_gpu on a tiny setting: it really runs each engine alone (the fake one,
and the real one around the simulated device with its core in this process or its own) and
through Redis in every worker mode, and prints a ratio and where the time goes for each."""

from __future__ import annotations

import re

import pytest

from benchmarks import simulated_gpu as bench

pytestmark = pytest.mark.timeout(180)


def test_a_tiny_run_prints_every_mode_with_measured_figures(capsys, tmp_path):
    argv = ["--setting", "2x4", "--tokens", "6", "--rounds", "1", "--checkpoint",
            str(tmp_path / "ckpt")]
    for mode in bench.MODES:
        argv += ["--mode", mode]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(r"^2 ms x 4 \(6 tokens each\): alone engine \d+, engine-process \d+, "
                     r"fake \d+ token events/s", out, re.M), out
    for mode in bench.MODES:
        line = next(x for x in out.splitlines() if x.strip().split()[0] == mode)
        ratio = float(re.search(r"ratio (\d+\.\d+)", line).group(1))
        assert 0.05 < ratio < 3.0, line
        flushes = float(re.search(r"([\d.]+) flush round trips", line).group(1))
        assert flushes >= 0.5, line           # about one per step, counted by the worker
        assert re.search(r"worker CPU [\d.]+ ms \([\d.]+ us/seq; of which events and flush "
                         r"[\d.]+ ms, [\d.]+ us/seq\)", line), line
        events = float(re.search(r"events and flush ([\d.]+) ms", line).group(1))
        assert events > 0, line               # the worker's metric counts every flush
        assert re.search(r"redis CPU [\d.]+ ms, reader CPU [\d.]+ ms", line), line
        assert re.search(r"p99 [\d.]+ ms", line), line
    assert "load average:" in out


def test_the_engine_alone_counts_one_event_per_sequence_per_step(tmp_path):
    s = bench.Setting(step_ms=1.0, seqs=3, tokens=5)
    rate = bench.engine_alone(s, bench.workload(s, 0), "fake", tmp_path)
    assert 100 < rate < 3 / 0.001 * 1.2        # 3 events per >= 1 ms step
