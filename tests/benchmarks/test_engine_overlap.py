"""benchmarks.engine_overlap on a tiny setting: every engine mode (serial, overlapped, the
core in its own process) really runs around the simulated device and prints measured figures."""

from __future__ import annotations

import re

import pytest

from benchmarks import engine_overlap as bench

pytestmark = pytest.mark.timeout(240)


def test_a_tiny_run_prints_both_modes_with_measured_figures(tmp_path, capsys):
    assert bench.main(["--setting", "1x8", "--steps", "5",
                       "--checkpoint", str(tmp_path / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^1 ms x 8: 5 decode steps", out, re.M)
    for mode in bench.MODES:
        line = next(x for x in out.splitlines() if x.strip().startswith(mode))
        wall = float(re.search(r"wall ([\d.]+) ms/step", line).group(1))
        assert wall >= 1.0, line          # never faster than the simulated device
        cpu = r"CPU [\d.]+ ms/step( = core [\d.]+ \+ front [\d.]+)? \([\d.]+ us/seq/step\)"
        assert re.search(cpu, line), line
        assert (" = core " in line) == (mode == "process"), line
        # A core in its own process runs ahead: its steps arrive several at a time.
        steps, tokens = map(int, re.search(r"\((\d+) steps, (\d+) tokens\)", line).groups())
        assert steps >= 5 and tokens == 8 * steps, line
    assert "load average:" in out
    phases = re.search(r"host ms/step: (.*)", out).group(1)
    assert {"schedule", "prepare", "launch", "wait", "output"} <= set(phases.split()[::2])


def test_the_simulated_model_is_deterministic_and_varies_by_position():
    import torch
    from tokenrelay.engine.simulated import SimulatedDeviceModel
    model = SimulatedDeviceModel(vocab_size=50, device_s=0.0)
    hidden = model(torch.tensor([3, 3]), torch.tensor([0, 1]), None, None)
    logits = model.compute_logits(hidden)
    assert logits.argmax(-1).tolist() == [21, 22]
