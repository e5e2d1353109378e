"""The engine's side of structured outputs: requests waiting for their grammar, and the masks.

A constrained request does not enter the scheduler when it is added: its sequences wait here
(``Waiting``) while the grammar compiles on ``GrammarCompiler``'s threads, and every other
request keeps decoding. Each step the engine calls ``poll``: requests whose matchers are ready
get them attached and go to the scheduler (preemption never touches them again: a preempted
sequence keeps its tokens, and so its matcher's state); requests whose compile failed, or
waited past ``grammar_compile_timeout_s``, come back as errors that end that request alone.

Before sampling, ``masks`` asks each constrained row's matcher which tokens may come next: one
bitmask per row (32 tokens a word, filled by llguidance with the GIL released), unpacked into a
boolean ``[rows, vocab]`` tensor the sampler applies to the logits. Ids past the tokenizer's
vocabulary (a model's padded embedding rows) are never allowed. The time spent is the
``structured_mask_*`` statistics.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence as Seq

import numpy as np
import torch

from tokenrelay.engine.grammar import Constraint, GrammarCompiler, GrammarError
from tokenrelay.engine.sequence import Sequence
from tokenrelay.protocol.structured_outputs import StructuredOutputsParams


@dataclass
class Waiting:
    """A constrained request whose matchers are being prepared: the sequences it will run."""

    request_id: str
    seqs: list[Sequence]
    key: str
    future: "Future[list[Constraint]]"
    deadline: float                       # time.monotonic() past which it fails


@dataclass
class RowMasks:
    """Which tokens each constrained row may sample: ``rows`` index the sampler's rows,
    ``allowed`` is ``[len(rows), vocab]`` bool on the logits' device."""

    rows: list[int]
    allowed: torch.Tensor


@dataclass
class Polled:
    """What one poll found: sequences ready to schedule, and requests that failed."""

    ready: list[Sequence] = field(default_factory=list)
    failed: list[tuple[str, GrammarError]] = field(default_factory=list)


class StructuredOutputs:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Seq[int], *,
                 threads: int, timeout_s: float) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids,
                                        threads=threads, timeout_s=timeout_s)
        self.vocab_size = vocab_size
        self.tokenizer_vocab = min(vocab_size, len(tokenizer))
        self.timeout_s = timeout_s
        self.waiting: dict[str, Waiting] = {}
        self._words = (max(vocab_size, len(tokenizer)) + 31) // 32
        self._bitmask = torch.zeros((0, self._words), dtype=torch.int32)
        self.mask_seconds = 0.0
        self.mask_steps = 0
        self.mask_rows = 0

    # -- requests waiting for their grammar ------------------------------------------------
    def add(self, request_id: str, spec: StructuredOutputsParams,
            seqs: list[Sequence], owner: Optional[str] = None) -> None:
        """Start preparing one matcher per sequence (each replays the tokens it already has:
        a resumed choice's), queued fairly among owners (the job's producer: one producer's
        backlog cannot hold every compile thread). Raises GrammarError when the spec is known
        to fail."""
        replays = [s.output_token_ids for s in seqs]
        future = self.compiler.submit(spec, replays, owner)
        self.waiting[request_id] = Waiting(request_id, seqs, spec.canonical, future,
                                           time.monotonic() + self.timeout_s)

    def abort(self, request_id: str) -> bool:
        w = self.waiting.pop(request_id, None)
        if w is None:
            return False
        w.future.cancel()
        return True

    def poll(self, block: bool) -> Polled:
        """Collect what finished. ``block``: nothing else can run, so wait (briefly) for a
        compile instead of returning at once and letting the caller spin."""
        if block and self.waiting:
            nearest = min(w.deadline for w in self.waiting.values())
            wait([w.future for w in self.waiting.values()], return_when=FIRST_COMPLETED,
                 timeout=max(0.0, min(0.05, nearest - time.monotonic())))
        out = Polled()
        now = time.monotonic()
        for rid, w in list(self.waiting.items()):
            if w.future.done():
                del self.waiting[rid]
                self._collect(w, out)
            elif now >= w.deadline:
                del self.waiting[rid]
                w.future.cancel()
                out.failed.append((rid, self.compiler.expire(w.key)))
        return out

    @staticmethod
    def _collect(w: Waiting, out: Polled) -> None:
        try:
            constraints = w.future.result()
        except GrammarError as exc:
            out.failed.append((w.request_id, exc))
            return
        except Exception as exc:  # anything else the pool raised ends this request alone
            out.failed.append((w.request_id, GrammarError(f"{type(exc).__name__}: {exc}")))
            return
        for seq, c in zip(w.seqs, constraints):
            seq.constraint = c
        out.ready.extend(w.seqs)

    # -- masks -----------------------------------------------------------------------------
    def masks(self, seqs: Seq[Sequence], device: torch.device
              ) -> tuple[Optional[RowMasks], list[Sequence]]:
        """The allowed tokens of every constrained row of ``seqs``, and the sequences whose
        matcher is in its error state (their request must end)."""
        rows = [i for i, s in enumerate(seqs) if s.constraint is not None]
        if not rows:
            return None, []
        t0 = time.perf_counter()
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = torch.zeros((max(len(rows), 2 * self._bitmask.shape[0]),
                                         self._words), dtype=torch.int32)
        buf = self._bitmask
        stride = self._words * 4
        base = buf.data_ptr()
        broken = []
        for j, i in enumerate(rows):
            m = seqs[i].constraint.matcher
            m.unsafe_compute_mask_ptr(base + j * stride, stride)
            if m.is_error():
                broken.append(seqs[i])
        bits = np.unpackbits(buf[:len(rows)].numpy().view(np.uint8), axis=1,
                             bitorder="little")[:, :self.vocab_size]
        allowed = torch.from_numpy(bits.view(np.bool_))
        if self.tokenizer_vocab < self.vocab_size:
            allowed[:, self.tokenizer_vocab:] = False
        allowed = allowed.to(device, non_blocking=True)
        self.mask_seconds += time.perf_counter() - t0
        self.mask_steps += 1
        self.mask_rows += len(rows)
        return RowMasks(rows, allowed), broken

    # -- statistics ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        steps = self.mask_steps
        return {
            **self.compiler.stats(),
            "num_compiling": len(self.waiting),
            "structured_mask_seconds": self.mask_seconds,
            "structured_mask_steps": steps,
            "structured_mask_rows": self.mask_rows,
            "structured_mask_ms_per_step": 1000 * self.mask_seconds / steps if steps else 0.0,
        }

    def close(self) -> None:
        self.compiler.close()
