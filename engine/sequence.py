"""Sequence: one request's tokens and where it stands in the engine.

There is no separate "prefill" and "decode" state (the vLLM v1 idea): a sequence simply has
``num_tokens`` tokens, of which ``num_computed_tokens`` already have their KV in the cache.
Every step the scheduler hands it some of the remaining ones; when the last one is computed the
model's logits for it are sampled and one token is appended. A fresh prompt, a chunked prompt, a
decode, a preempted sequence being recomputed and a resumed request are all the same thing.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any, Optional

from tokenrelay.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenrelay.engine.grammar import Constraint


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # queued, or preempted and waiting to be recomputed
    RUNNING = "running"      # owns KV blocks, scheduled every step while budget allows
    FINISHED = "finished"    # done or aborted; owns nothing


class SequenceGroup:
    """The sequences of one request: one per choice (``n`` samples or the beams).

    A fresh request is one sequence, its prompt; when the prompt's last token is computed it
    forks into ``width`` sequences that share the prompt's KV blocks by reference count
    (copy on write for the partly filled block). A beam group moves in lockstep: all its beams
    decode in the same step, because each beam step ranks the continuations of all of them.
    The scheduler preempts and frees a group as a whole.
    """

    def __init__(self, request_id: str, width: int, *, params: Optional[SamplingParams] = None,
                 seed: int = 0, beam: Optional[Any] = None) -> None:
        self.request_id = request_id
        self.width = width                  # choices the request returns
        self.params = params
        self.seed = seed                    # the request's; choice i samples with branch_seed
        self.seqs: list["Sequence"] = []    # live (unfinished) sequences
        self.finished: dict[int, "Sequence"] = {}   # sampled choices that ended, by index
        self.forked = width == 1            # True once the choices have their own sequences
        self.beam = beam                    # engine.beam_search.BeamSearch for beam requests

    @property
    def lockstep(self) -> bool:
        return self.beam is not None and len(self.seqs) > 1

    def slots(self) -> int:
        """Sequence slots the group holds or will hold once forked (for max_num_seqs)."""
        return len(self.seqs) if self.forked else self.width


class Sequence:
    """Token ids (prompt then outputs), KV block table and sampling state of one choice."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 *, priority: int, arrival_index: int, seed: int,
                 index: int = 0,
                 group: Optional[SequenceGroup] = None) -> None:
        self.request_id = request_id
        self.index = index                      # the choice: sample i of n, or beam slot
        self.group = group if group is not None else SequenceGroup(request_id, 1)
        self.group.seqs.append(self)
        self.params = params
        self.priority = priority
        self.arrival_index = arrival_index      # tie-breaker: earlier requests first
        self.seed = seed
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.table_row = -1                     # its row in BlockManager.tables, once it has blocks
        self.block_hashes: list[int] = []       # chained hashes of full blocks, filled lazily
        self.num_cached_blocks = 0              # leading blocks already offered to the prefix cache
        self.status = SequenceStatus.WAITING
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[str | int] = None
        # Sampled-token bookkeeping:
        self.output_logprobs: list[Optional[dict[int, float]]] = []
        self.cumulative_logprob = 0.0
        # Structured outputs: the matcher of this sequence's output (engine/grammar.py); it has
        # consumed exactly the output tokens, and survives preemption with them.
        self.constraint: Optional["Constraint"] = None
        # Can its steps overlap (engine/overlap.py)? Not when the next draw needs this step's
        # token on the host: a grammar, beam search, penalties.
        self.overlappable = (params.structured_outputs is None and not params.use_beam_search
                             and not params.has_penalties)
        # Timing (wall clock, seconds):
        self.arrival_time = time.time()
        self.first_token_time: Optional[float] = None
        self.finished_time: Optional[float] = None

    # -- sizes -----------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def fork(self, index: int, seed: int) -> "Sequence":
        """A sibling with the same tokens and block table (the caller takes the block
        references, see BlockManager.fork) and its own sampling state from here on."""
        child = Sequence(self.request_id, self.prompt_token_ids, self.params,
                         priority=self.priority, arrival_index=self.arrival_index, seed=seed,
                         index=index, group=self.group)
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.block_table = list(self.block_table)
        child.block_hashes = list(self.block_hashes)
        child.num_cached_blocks = self.num_cached_blocks
        child.status = self.status
        child.output_logprobs = list(self.output_logprobs)
        child.cumulative_logprob = self.cumulative_logprob
        child.constraint = self.constraint.fork() if self.constraint is not None else None
        child.arrival_time = self.arrival_time
        child.first_token_time = self.first_token_time
        return child

    def sort_key(self) -> tuple[int, int]:
        """Lower runs first: priority number, then arrival order."""
        return (self.priority, self.arrival_index)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")
