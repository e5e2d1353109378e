"""``python -m benchmarks.engine_overlap``: does the engine keep a (simulated) GPU busy?

The real ``LLMEngine`` (scheduler, sampler, output processing, detokenizer) runs around a
model whose forward pass takes a fixed device time and releases the GIL while it does, as a
CUDA sync does (``EngineConfig.simulated_device_ms``, engine/simulated.py). Its logits are
cheap and deterministic (a token picked from the input token and position), so the host's
cost is the engine's own.

For each setting (``2x256``: a 2 ms step at 256 decoding sequences) and each engine mode
(``serial``: schedule, run, sample, process, one after the other; ``overlapped``: the engine
core schedules and launches step N+1 before it processes step N's results, see
engine/overlap.py; ``process``: the overlapped core in a process of its own, this process
turning its ids into text, engine/core_client.py) it prefills every sequence, then times
``--steps`` decode steps and prints:

- wall ms per step, against the device time and against ``max(device, CPU per step)``, the best
  a loop could do (wall / device: 1.0 means the device never waits);
- the CPU time of the engine per step (this process's CPU seconds, which the sleeping device
  does not add to) and per sequence per step; in ``process`` mode the core's process and this
  one (the output processor) each, and their sum.

Every mode runs under the worker's heap settings (tokenrelay/heap.py: the heap frozen once the
engine is loaded, young collections every 10,000 allocations). Figures are wall-clock on a
shared host: other processes' load shows up as CPU time.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from tokenrelay.engine.llm_engine import LLMEngine
from tokenrelay.engine.sampling_params import SamplingParams
from tokenrelay.heap import serve_heap, thaw_heap

MODES = ("serial", "overlapped", "process")


@dataclass(frozen=True)
class Setting:
    device_ms: float
    seqs: int

    @property
    def label(self) -> str:
        return f"{self.device_ms:g} ms x {self.seqs}"


@dataclass(frozen=True)
class Result:
    mode: str
    wall_ms: float          # per step
    cpu_ms: float           # per step, this process
    steps: int
    tokens: int
    phases: Optional[dict[str, float]] = None   # overlapped: host ms per step by phase
    core_cpu_ms: Optional[float] = None         # process: the core's process, per step
    lane_ms: Optional[float] = None             # overlapped: the device's busy time

    def line(self, s: Setting) -> str:
        core = self.core_cpu_ms
        # Two processes run side by side: the step is paced by the busier one.
        best = max(s.device_ms, self.cpu_ms if core is None else max(core, self.cpu_ms))
        total = self.cpu_ms + (core or 0.0)
        per_seq_us = total * 1000.0 / s.seqs
        split = "" if core is None else f" = core {core:.2f} + front {self.cpu_ms:.2f}"
        return (f"  {self.mode:<10} wall {self.wall_ms:.2f} ms/step  device {s.device_ms:g} ms  "
                f"CPU {total:.2f} ms/step{split} ({per_seq_us:.1f} us/seq/step)  "
                f"wall/max(device, CPU) {self.wall_ms / best:.2f}  "
                f"wall/device {self.wall_ms / s.device_ms:.2f}  ({self.steps} steps, "
                f"{self.tokens} tokens)" + self._lane_text(s) + self._phase_text())

    def _lane_text(self, s: Setting) -> str:
        """The simulated device's busy time per step (its stream's clock, engine/simulated.py:
        the step's Python runs on the host, as on a GPU); wall/busy 1.0: it never idled."""
        if self.lane_ms is None:
            return ""
        return (f"\n             device busy {self.lane_ms:.2f} ms/step; "
                f"wall/busy {self.wall_ms / self.lane_ms:.2f}")

    def _phase_text(self) -> str:
        """The overlapped core's host ms per phase (engine/overlap.py ``PhaseClock``); on this
        simulated device ``wait`` is the device time the host did not hide."""
        if not self.phases:
            return ""
        return "\n             host ms/step: " + "  ".join(
            f"{k} {v:.2f}" for k, v in self.phases.items())


def parse_setting(text: str) -> Setting:
    """``2x256`` -> a 2 ms device step, 256 sequences."""
    ms, _, seqs = text.lower().partition("x")
    return Setting(float(ms), int(seqs))


def make_engine(checkpoint: Path, s: Setting, mode: str, max_tokens: int) -> Any:
    from tokenrelay.engine.config import EngineConfig
    blocks_per_seq = -(-(16 + max_tokens + 2) // 16)
    config = EngineConfig(model=str(checkpoint), device="cpu", dtype="float32",
                          max_num_seqs=s.seqs, max_num_batched_tokens=max(2048, 16 * s.seqs),
                          num_kv_blocks=s.seqs * blocks_per_seq + 8, max_model_len=1024,
                          async_scheduling=(mode != "serial"), simulated_device_ms=s.device_ms)
    if mode == "process":
        from tokenrelay.engine.core_client import EngineCoreClient
        return EngineCoreClient(config, threads=1)
    return LLMEngine(config)


def core_cpu_s(engine: Any) -> float:
    """CPU seconds of the engine core's own process (0 for an in-process core)."""
    proc = getattr(engine, "proc", None)
    if proc is None:
        return 0.0
    import psutil
    t = psutil.Process(proc.pid).cpu_times()
    return t.user + t.system


def run_mode(checkpoint: Path, s: Setting, mode: str, steps: int) -> Result:
    """Prefill ``s.seqs`` sequences, then time ``steps`` decode steps."""
    max_tokens = steps + 16
    engine = make_engine(checkpoint, s, mode, max_tokens)
    thresholds = gc.get_threshold()
    serve_heap()                            # the worker's heap settings (tokenrelay/heap.py)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(s.seqs):
        engine.add_request(f"r{i}", [5 + (i * 13 + k) % 500 for k in range(16)], params)
    overlap = getattr(engine, "overlap", None)
    warm = 0
    while warm < 3 * s.seqs:                 # the prefill, and the pipeline filling
        warm += sum(len(d.new_token_ids) for d in engine.step())
    tokens = 0
    if overlap is not None:
        overlap.phases.reset()
    lane0 = overlap.lane.busy_s if overlap is not None else 0.0
    wall, cpu, core = time.perf_counter(), time.process_time(), core_cpu_s(engine)
    while tokens < steps * s.seqs:          # a process core's steps come several at a time
        tokens += sum(len(d.new_token_ids) for d in engine.step())
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    core = core_cpu_s(engine) - core
    lane = (overlap.lane.busy_s - lane0) if overlap is not None else None
    done = tokens / s.seqs
    phases = overlap.phases.ms_per_step() if overlap is not None else None
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()
    thaw_heap()
    gc.set_threshold(*thresholds)
    return Result(mode, wall * 1000.0 / done, cpu * 1000.0 / done, round(done), tokens, phases,
                  core * 1000.0 / done if mode == "process" else None,
                  lane * 1000.0 / done if lane is not None else None)


def checkpoint_dir(path: Optional[str]) -> Path:
    """A tiny random checkpoint (its tokenizer and config: the model itself is simulated)."""
    from tokenrelay.engine.tiny import write_checkpoint
    out = Path(path) if path else Path(tempfile.mkdtemp(prefix="engine-overlap-"))
    if not (out / "config.json").exists():
        write_checkpoint(out, arch="llama", size="tiny")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", action="append", default=None,
                        help="DEVICE_MSxSEQS, repeatable (default 2x256 and 2x64)")
    parser.add_argument("--steps", type=int, default=100, help="timed decode steps")
    parser.add_argument("--mode", choices=(*MODES, "both"), default="both")
    parser.add_argument("--checkpoint", default=None,
                        help="folder for the tiny checkpoint (written when missing)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)                 # the simulated device needs no CPU threads
    checkpoint = checkpoint_dir(args.checkpoint)
    modes = MODES if args.mode == "both" else (args.mode,)
    for s in [parse_setting(t) for t in (args.setting or ["2x256", "2x64"])]:
        print(f"{s.label}: {args.steps} decode steps", flush=True)
        for mode in modes:
            print(run_mode(checkpoint, s, mode, args.steps).line(s), flush=True)
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
