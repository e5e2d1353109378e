"""The overlapped engine core (engine/overlap.py) gives the serial engine's results: tokens,
text, logprobs, finish reasons, exactly, under preemption, prefix caching, chunked prefill,
stop strings, EOS, n > 1, beam search, penalties and aborts; and it really overlaps."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from tokenrelay.engine import LLM, SamplingParams
from tokenrelay.engine.llm_engine import LLMEngine
from tokenrelay.engine.overlap import PLACEHOLDER

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def mixed(n: int = 24, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """Shared prefixes, greedy and seeded rows, EOS on, stop strings, logprobs, min_tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(5, 1000) for _ in range(40)]
    prompts, params = [], []
    for i in range(n):
        own = [rng.randrange(5, 1000) for _ in range(rng.randrange(3, 70))]
        prompts.append(shared + own if i % 2 else own)
        params.append(SamplingParams(
            temperature=0.0 if i % 3 == 0 else 0.9, top_p=0.9 if i % 4 == 1 else 1.0,
            seed=1000 + i, max_tokens=rng.randrange(4, 30), ignore_eos=i % 5 == 0,
            stop=["e", "ab"] if i % 4 == 2 else None, logprobs=2 if i % 6 == 1 else None,
            min_tokens=3 if i % 7 == 3 else 0))
    return prompts, params


def summary(outs) -> list[tuple]:
    return [(o.request_id, c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason,
             c.logprobs, c.cumulative_logprob) for o in outs for c in o.outputs]


def assert_same(overlapped: list[tuple], serial: list[tuple]) -> None:
    """Tokens, text and finish reasons exactly; logprobs exactly when both engines batched
    alike, else within float32 rounding: a choice that stops with a stop string or EOS had
    a token speculated in the next step, so budgets (chunking) can differ, and the model's
    logits are not bitwise batch-invariant (tests/engine/test_invariance.py checks tokens)."""
    assert [r[:6] for r in overlapped] == [r[:6] for r in serial]
    for a, b in zip(overlapped, serial):
        assert (a[7] is None) == (b[7] is None), a[0]
        if a[7] is not None:
            assert a[7] == pytest.approx(b[7], rel=1e-5, abs=1e-5), a[0]
        assert (a[6] is None) == (b[6] is None), a[0]
        for da, db in zip(a[6] or [], b[6] or []):
            assert da.keys() == db.keys() and all(
                da[k] == pytest.approx(db[k], rel=1e-5, abs=1e-5) for k in da), a[0]


def both(model_path: str, prompts, params, **kwargs) -> tuple[list, list]:
    runs = []
    for mode in (False, True):
        llm = LLM(model_path, async_scheduling=mode, **kwargs)
        try:
            runs.append(summary(llm.generate(prompts, params)))
        finally:
            llm.shutdown()
    return runs[0], runs[1]


@pytest.mark.parametrize("kwargs", [
    dict(num_kv_blocks=1024),                                   # prefix caching, plenty
    dict(num_kv_blocks=1024, max_num_batched_tokens=16),        # chunked prefill
    dict(num_kv_blocks=24, block_size=8),                       # preemption
    dict(num_kv_blocks=1024, enable_prefix_caching=False, max_num_seqs=5),
], ids=["cached", "chunked", "preempted", "few-seqs"])
def test_overlapped_equals_serial(model_path, kwargs):
    prompts, params = mixed()
    serial, overlapped = both(model_path, prompts, params, **kwargs)
    assert_same(overlapped, serial)
    assert any(row[4] == "stop" for row in serial) and any(row[4] == "length" for row in serial)


def test_forks_beams_and_penalties_fall_back_to_serial_steps(model_path):
    """n > 1, beam search and penalties need the host's tokens: those steps run serially,
    beside plain requests that overlap before and after them."""
    prompts, params = mixed(8, seed=3)
    prompts += [prompts[0], prompts[1], prompts[2]]
    params += [SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=12),
               SamplingParams(beam_width=3, max_tokens=6, ignore_eos=True),
               SamplingParams(repetition_penalty=1.3, temperature=0.0, max_tokens=10)]
    serial, overlapped = both(model_path, prompts, params, num_kv_blocks=1024)
    assert_same(overlapped, serial)


def test_aborts_between_steps_drop_the_draw_in_flight(model_path):
    prompts, params = mixed(12, seed=5)
    results = []
    for mode in (False, True):
        engine = LLMEngine.from_kwargs(model=model_path, num_kv_blocks=1024,
                                       async_scheduling=mode)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", p, sp)
        got: dict[str, list[int]] = {}
        steps = 0
        while engine.has_unfinished_requests():
            for d in engine.step():
                got.setdefault(d.request_id, []).extend(d.new_token_ids)
            steps += 1
            if steps == 4:      # one request mid-decode, one after its delta was returned
                assert engine.abort_request("r3") and engine.abort_request("r8")
        assert engine.block_manager.num_used_blocks == 0 or engine.config.enable_prefix_caching
        assert engine.scheduler.running == [] and engine.requests == {}
        engine.shutdown()
        results.append(got)
    serial, overlapped = results
    for rid in ("r3", "r8"):    # the overlapped engine returned one step fewer before the abort
        assert serial[rid][:len(overlapped.get(rid, []))] == overlapped.get(rid, [])
        serial.pop(rid), overlapped.pop(rid, None)
    assert overlapped == serial


def test_no_placeholder_survives_and_the_stats_add_up(model_path):
    prompts, params = mixed(10, seed=9)
    llm = LLM(model_path, num_kv_blocks=1024, async_scheduling=True)
    outs = llm.generate(prompts, params)
    for o in outs:
        assert PLACEHOLDER not in o.outputs[0].token_ids
    stats = llm.stats()
    assert stats["num_generated_tokens"] == sum(len(o.outputs[0].token_ids) for o in outs)
    assert stats["num_steps"] > 0 and stats["num_running"] == 0
    llm.shutdown()


class SlowModel:
    """Wraps a model: every forward also sleeps, the GIL released, as a device step would."""

    def __init__(self, model, delay_s: float) -> None:
        self.model, self.delay_s = model, delay_s
        self.ops = getattr(model, "ops", None)
        self.threads: set[str] = set()

    def __call__(self, *args):
        self.threads.add(threading.current_thread().name)
        time.sleep(self.delay_s)
        return self.model(*args)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


def test_the_forward_runs_on_the_device_thread(model_path):
    """On CPU the launched step runs on the core's device thread, so the host's scheduling
    and processing of the previous step run beside it (benchmarks.engine_overlap measures
    how much that hides)."""
    from tokenrelay.engine.loader import load_model
    base = load_model(model_path, dtype=torch.float32, device="cpu", backend="torch")
    slow = SlowModel(base, 0.03)
    engine = LLMEngine.from_kwargs(model=model_path, num_kv_blocks=256, async_scheduling=True,
                                   model_object=slow, enforce_eager=True)
    for i in range(8):
        engine.add_request(f"r{i}", [7 + i] * 20, SamplingParams(max_tokens=12, ignore_eos=True,
                                                                  temperature=0.0))
    engine.step()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    engine.shutdown()
    assert slow.threads and all(n.startswith("engine-device") for n in slow.threads)
    assert steps >= 11


def test_the_phase_clock_charges_the_device_time_to_the_wait(model_path):
    """The per-phase host times the GPU check prints add up to the steps' wall time, and a
    slow device shows up as waiting for the previous step's ids, not in any host phase."""
    from tokenrelay.engine.loader import load_model
    base = load_model(model_path, dtype=torch.float32, device="cpu", backend="torch")
    engine = LLMEngine.from_kwargs(model=model_path, num_kv_blocks=256, async_scheduling=True,
                                   model_object=SlowModel(base, 0.03), enforce_eager=True)
    for i in range(4):
        engine.add_request(f"r{i}", [7 + i] * 20, SamplingParams(max_tokens=20, ignore_eos=True,
                                                                  temperature=0.0))
    for _ in range(3):
        engine.step()
    engine.overlap.phases.reset()
    t0 = time.perf_counter()
    for _ in range(10):
        engine.step()
    wall_ms = (time.perf_counter() - t0) * 1000 / 10
    phases = engine.overlap.phases.ms_per_step()
    engine.shutdown()
    assert {"schedule", "prepare", "launch", "wait", "output", "update"} <= set(phases)
    assert abs(sum(phases.values()) - wall_ms) < 0.1 * wall_ms
    assert phases["wait"] > 20 and phases["launch"] < 5


def test_async_scheduling_defaults_off_on_cpu_and_refuses_tensor_parallelism(model_path):
    from tokenrelay.engine.config import EngineConfig
    assert EngineConfig(model=model_path, device="cpu").resolve().async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling needs tensor_parallel_size=1"):
        EngineConfig(model=model_path, device="cpu", tensor_parallel_size=2,
                     async_scheduling=True).resolve()
