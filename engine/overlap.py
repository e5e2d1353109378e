"""The overlapped engine core: the host schedules and launches step N+1 while the device
computes step N, and processes N's results only after N+1 is on its way.

One call of :meth:`OverlappedCore.step` (``LLMEngine.step`` with ``async_scheduling``):

1. schedule N+1 as if every choice sampled in N already had its token: N's draw sits in the
   choice's ``token_ids`` as ``PLACEHOLDER``, so sizes, block needs and output positions
   (seeds, ``min_tokens``) are those the serial engine would see;
2. prepare N+1 on the host and launch it (:class:`DeviceLane`): an input id that is still a
   placeholder is filled on the device from N's sampled ids (``step_inputs.Placeholders``);
   N+1's own draws get placeholders at once;
3. wait for N's sampled ids (the step's one host sync), process them (tokens replace their
   placeholders, finish rules) and return N's outputs (ids: the output processor makes the
   text and finds stop strings, engine/output_processor.py);
4. ``Scheduler.update`` for N+1: its inputs are all real tokens now, so the full blocks it
   completes can be hashed for the prefix cache.

Invariants (what keeps the results those of the serial engine):

- At most one step is in flight; when a call starts, the only placeholders are N's, each the
  last token of its choice. No host code reads a placeholder's value: prefix matching and
  sibling sharing stop one token short of a sequence's end, and block hashes are computed in
  step 4, after N's tokens replaced them.
- A choice that ends with N's token (stop token, EOS, or a stop string, which the output
  processor reports through ``EngineCore.finish_choice``) was speculatively given a
  token in N+1: its blocks are freed when N is processed, the placeholders past its last
  token are dropped (``FinishRules.process``), and N+1's draw for it is discarded (a
  finished sequence is skipped when N+1 is processed, and by ``Scheduler.update``). A choice
  that certainly ends with N's token (``max_tokens``, ``max_model_len``) is held out of N+1.
  So tokens, text and logprobs are the serial engine's; what can differ is only the
  schedule, by the speculated tokens of choices that stop (budget, blocks): outputs stay the
  same wherever the model is batch-invariant, as it is in float32 on CPU.
- Aborts between calls only mark sequences finished; their in-flight draws are dropped. The
  device runs steps in launch order (one CUDA stream, or one thread), so a block freed and
  reused is written by the new owner after the old step's writes.
- Whatever needs a token on the host before the next step is sampled runs serially: the
  engine drains the step in flight and steps serially while any live sequence has a grammar
  (the mask of N+1 needs the matcher advanced by N's token), beam search (a beam step ranks
  all beams on the host), penalties (they read the tokens), or is a prompt about to fork
  into ``n`` choices (the fork happens before its first draw). The cost: those steps lose
  the overlap, for every request in them; plain requests overlap again once they are gone.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from tokenrelay.engine.model_runner import ModelRunner
from tokenrelay.engine.finish_rules import FinishRules
from tokenrelay.engine.outputs import CoreOutput, StepCounters
from tokenrelay.engine.sampler import DeviceSample, Sampler, SamplerOutput, SamplingBatch
from tokenrelay.engine.scheduler import Scheduler, SchedulerOutput
from tokenrelay.engine.sequence import Sequence
from tokenrelay.engine.simulated import SimulatedStream
from tokenrelay.engine.step_inputs import Placeholders, StepInputs

PLACEHOLDER = -1        # a token drawn on the device and not yet known on the host


@dataclass
class InFlight:
    """A launched step: what was scheduled, who draws, where their tokens will go."""

    out: SchedulerOutput
    seqs: list[Sequence]            # the rows that draw a token, in logits order
    positions: list[int]            # each row's placeholder index in its token_ids
    row_of: dict[int, int]          # id(seq) -> row: fills the next step's placeholders
    batch: SamplingBatch
    tokens: Optional[torch.Tensor] = None     # the draws, on the device, once launched
    result: Any = field(default=None, repr=False)   # Future or _Queued


class _Queued:
    """A step launched on CUDA: its kernels and its draws' copy to pinned host memory are
    queued; ``result`` waits for that copy's event (the step's one sync)."""

    def __init__(self, sample: Optional[DeviceSample]) -> None:
        self.sample = sample
        self.event = None
        if sample is not None:
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> Optional[DeviceSample]:
        if self.event is not None:
            self.event.synchronize()
        return self.sample


class _Simulated:
    """A step launched on a simulated device (engine/simulated.py): its Python ran at launch,
    as a GPU step's does; ``result`` sleeps until the stream's clock says its device work is
    done (the sync)."""

    def __init__(self, stream: SimulatedStream, sample: Optional[DeviceSample]) -> None:
        self.stream = stream
        self.ready_at = stream.ready_at
        self.sample = sample

    def result(self) -> Optional[DeviceSample]:
        self.stream.wait_until(self.ready_at)
        return self.sample


class DeviceLane:
    """Where launched steps run, in launch order. On CUDA the host queues the kernels and goes
    on; on a simulated device likewise (its stream keeps the device's clock); on CPU one
    background thread runs them, the GIL released in torch's kernels."""

    def __init__(self, device: torch.device, simulated: Optional[SimulatedStream] = None) -> None:
        self.cuda = device.type == "cuda"
        self.simulated = simulated
        self._pool = None if self.cuda or simulated is not None else ThreadPoolExecutor(
            1, thread_name_prefix="engine-device")
        self._thread_busy_s = 0.0

    @property
    def busy_s(self) -> float:
        """Seconds of device work so far: the simulated stream's, or the CPU lane thread's
        time on steps (torch's kernels and the Python around them). 0 on CUDA."""
        if self.simulated is not None:
            return self.simulated.busy_s
        return self._thread_busy_s

    def submit(self, job: Callable[[], Optional[DeviceSample]]) -> Any:
        if self.simulated is not None:
            with self.simulated.deferred():
                return _Simulated(self.simulated, job())
        if self._pool is None:
            return _Queued(job())
        return self._pool.submit(self._timed, job)

    def _timed(self, job: Callable[[], Optional[DeviceSample]]) -> Optional[DeviceSample]:
        t0 = time.perf_counter()
        try:
            return job()
        finally:
            self._thread_busy_s += time.perf_counter() - t0

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class PhaseClock:
    """Host seconds per phase of the overlapped step, summed over steps: what the GPU check
    prints so a run shows where a slow step's time goes (schedule, prepare, launch, wait for
    the previous step's ids, output processing, scheduler update, and ``engine``: the
    caller's time between steps). ``lap`` charges the time
    since the previous lap to ``phase``; a perf_counter read costs well under a microsecond."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.steps = 0
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

    def reset(self) -> None:
        self.seconds.clear()
        self.steps = 0
        self._last = time.perf_counter()

    def ms_per_step(self) -> dict[str, float]:
        return {k: 1000 * v / max(self.steps, 1) for k, v in self.seconds.items()}


class OverlappedCore:
    """Schedule, launch, then process the previous step (module docstring)."""

    def __init__(self, *, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler,
                 rules: FinishRules, counters: StepCounters,
                 max_model_len: int) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.rules = rules
        self.max_model_len = max_model_len
        self.lane = DeviceLane(runner.device, simulated=runner.simulated_stream)
        self.flight: Optional[InFlight] = None
        self.counters = counters
        self.phases = PhaseClock()

    def eligible(self) -> bool:
        """True when every live sequence's next draw needs nothing from the host."""
        sched = self.scheduler
        return all(s.overlappable and s.group.forked for s in sched.running) and \
            all(s.overlappable and s.group.forked for s in sched.waiting)

    def step(self) -> tuple[list[CoreOutput], list[str]]:
        """Launch the next step, then process the one in flight: (its outputs, the ids of the
        requests whose last choice ended)."""
        prev = self.flight
        self.flight = None
        clock = self.phases
        clock.lap("engine")             # the caller's time since the last step returned
        if self.scheduler.has_unfinished():
            out = self.scheduler.schedule(self._certain_ends(prev))
            clock.lap("schedule")
            if not out.is_empty:
                self.flight = self._launch(out, prev)
        done = self._process(prev) if prev is not None else ([], [])
        if self.flight is not None:
            self.scheduler.update(self.flight.out)
        clock.lap("update")
        clock.steps += 1
        return done

    def drain(self) -> tuple[list[CoreOutput], list[str]]:
        """Process the step in flight, launching nothing: afterwards no placeholder is left."""
        prev, self.flight = self.flight, None
        return self._process(prev) if prev is not None else ([], [])

    def shutdown(self) -> None:
        self.lane.shutdown()

    # -- launching -------------------------------------------------------------------------
    def _certain_ends(self, prev: Optional[InFlight]) -> frozenset[Sequence]:
        """Choices whose token in flight is their last by length: no speculation past it."""
        if prev is None:
            return frozenset()
        return frozenset(
            s for s, pos in zip(prev.seqs, prev.positions)
            if pos + 1 - s.num_prompt_tokens >= s.params.max_tokens
            or pos + 1 >= self.max_model_len)

    def _launch(self, out: SchedulerOutput, prev: Optional[InFlight]) -> InFlight:
        step, rows = self.runner.prepare(out.seqs, out.num_new_tokens, out.block_copies)
        fill = self._fill(out, prev)
        seqs = [out.seqs[i] for i in rows]
        batch = SamplingBatch.of(seqs)
        positions = []
        for s in seqs:
            positions.append(len(s.token_ids))
            s.token_ids.append(PLACEHOLDER)
        flight = InFlight(out, seqs, positions, {id(s): j for j, s in enumerate(seqs)}, batch)
        self.phases.lap("prepare")
        flight.result = self.lane.submit(lambda: self._run(flight, step, prev, fill))
        self.phases.lap("launch")
        self.counters.num_steps += 1
        self.counters.num_computed_tokens += out.num_batched_tokens
        return flight

    @staticmethod
    def _fill(out: SchedulerOutput, prev: Optional[InFlight]
              ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(input rows, rows of the previous step's draws) for each input still a
        placeholder: a choice's last token, when this step's span reaches it."""
        if prev is None:
            return None
        dst: list[int] = []
        src: list[int] = []
        row_of = prev.row_of
        offset = 0
        for s, n in zip(out.seqs, out.num_new_tokens):
            offset += n
            toks = s.token_ids
            if toks[-1] == PLACEHOLDER and s.num_computed_tokens + n == len(toks):
                dst.append(offset - 1)
                src.append(row_of[id(s)])
        if not dst:
            return None
        return torch.tensor(dst, dtype=torch.int64), torch.tensor(src, dtype=torch.int64)

    def _run(self, flight: InFlight, step: StepInputs, prev: Optional[InFlight],
             fill: Optional[tuple[torch.Tensor, torch.Tensor]]) -> Optional[DeviceSample]:
        """The device's part: forward, draw, and (CUDA) the draws' copy to the host."""
        placeholders = None
        if fill is not None:
            placeholders = Placeholders(dst=fill[0], src=fill[1], source=prev.tokens)
        logits = self.runner.run(step, placeholders)
        if logits is None or not flight.seqs:
            return None
        drawn = self.sampler.sample(logits, flight.batch)
        flight.tokens = drawn.tokens
        return drawn.to_cpu(non_blocking=True) if self.lane.cuda else drawn

    # -- processing ------------------------------------------------------------------------
    def _process(self, flight: InFlight) -> tuple[list[CoreOutput], list[str]]:
        drawn = flight.result.result()
        self.phases.lap("wait")
        if drawn is None:
            return [], []
        sampled = drawn.output()
        keep = [j for j, s in enumerate(flight.seqs) if not s.is_finished]
        seqs, positions = flight.seqs, flight.positions
        if len(keep) != len(seqs):       # aborted, or ended with the previous step's token
            seqs = [seqs[j] for j in keep]
            positions = [positions[j] for j in keep]
            sampled = SamplerOutput([sampled.token_ids[j] for j in keep],
                                    [sampled.logprobs[j] for j in keep],
                                    [sampled.top_logprobs[j] for j in keep])
        if not seqs:
            return [], []
        done = self.rules.process(seqs, sampled, {}, time.time(), positions)
        self.phases.lap("output")
        return done
