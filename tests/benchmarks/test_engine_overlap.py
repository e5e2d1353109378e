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
        steps = int(re.search(r"\((\d+) steps", line).group(1))
        # never faster than the simulated device, but for the step already in flight when
        # the clock started (overlapped: its device time began before)
        assert wall * steps >= 1.0 * (steps - 1), line
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


def test_the_simulated_stream_queues_like_a_device_and_waits_only_where_asked():
    """A serial launch waits for its work; deferred launches return at once, queue behind each
    other, and ``wait_until`` sleeps until the queue's clock says they are done."""
    import time
    from tokenrelay.engine.simulated import SimulatedStream
    stream = SimulatedStream()
    t0 = time.perf_counter()
    stream.launch(0.05)
    assert time.perf_counter() - t0 >= 0.05
    t0 = time.perf_counter()
    with stream.deferred():
        stream.launch(0.1)
        first = stream.ready_at
        stream.launch(0.1)
    assert time.perf_counter() - t0 < 0.05            # nothing waited
    assert stream.ready_at - first == pytest.approx(0.1)
    stream.wait_until(first)
    assert 0.1 <= time.perf_counter() - t0 < 0.19
    stream.wait_until(stream.ready_at)
    assert time.perf_counter() - t0 >= 0.2
    assert stream.busy_s == pytest.approx(0.25)


def test_an_overlapped_core_launches_on_the_simulated_stream_without_a_thread(tmp_path):
    """The step's Python runs at launch on the host thread (as on a GPU), the device time on
    the stream: no lane thread waits for the GIL, and the device is busy device_ms a step."""
    from tokenrelay.engine.sampling_params import SamplingParams
    s = bench.Setting(5.0, 4)
    engine = bench.make_engine(bench.checkpoint_dir(str(tmp_path / "ckpt")), s, "overlapped", 8)
    try:
        lane = engine.overlap.lane
        assert lane.simulated is engine.overlap.runner.model.stream and lane._pool is None
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for i in range(4):
            engine.add_request(f"r{i}", [5, 6, 7 + i], params)
        tokens = 0
        while engine.has_unfinished_requests():
            tokens += sum(len(d.new_token_ids) for d in engine.step())
        assert tokens == 32
        assert lane.busy_s == pytest.approx(0.005 * engine.overlap.counters.num_steps)
    finally:
        engine.shutdown()
