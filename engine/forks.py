"""Forks: how one request's choices come to share KV blocks, and how beams fork and die.

Parallel sampling (``n > 1``): the prompt is one sequence until its last token is computed;
then, before that token's logits are sampled, it forks into ``n`` sequences that hold the same
blocks (one more reference each) and sample the same logits row with their own seeds. Choice i
draws with ``branch_seed(seed, i)`` at every position, so it is the same however it is batched,
and choice 0 is exactly the ``n = 1`` request with that seed.

Beam search: each step ``BeamSearch`` picks the next beams as (parent, token). The first beam
that continues a parent takes the parent's sequence itself; every further one forks it; a
parent that nobody continues is freed, and with it every block only it held.
"""

from __future__ import annotations

import time
from typing import Optional, Union

import torch

from tokenrelay.engine.beam_search import BeamStep
from tokenrelay.engine.grammar import GrammarError
from tokenrelay.engine.outputs import CoreOutput
from tokenrelay.engine.sampler import mix_seed
from tokenrelay.engine.scheduler import Scheduler
from tokenrelay.engine.sequence import Sequence, SequenceGroup
from tokenrelay.engine.structured import StructuredOutputs


def branch_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed: choice 0 keeps the request's, the others are spread from it."""
    return seed if index == 0 else mix_seed(seed ^ 0x5DEECE66D, -(index + 1))


def _fork(parent: Sequence, index: int, seed: int, scheduler: Scheduler) -> Sequence:
    child = parent.fork(index, seed)
    scheduler.block_manager.fork(parent, child)
    scheduler.add_fork(child)
    return child


def fork_samples(seq: Sequence, scheduler: Scheduler) -> list[Sequence]:
    """Fork a prompt whose last token was just computed into its group's ``n`` choices."""
    group = seq.group
    children = [seq]
    for i in range(1, group.width):
        children.append(_fork(seq, i, branch_seed(group.seed, i), scheduler))
    group.forked = True
    return children


def advance_beams(group: SequenceGroup, step: BeamStep, scheduler: Scheduler) -> Optional[str]:
    """Make ``group.seqs`` the beams ``step`` chose, each with its new token appended (and
    consumed by its matcher, under structured outputs: a fork copied the parent's matcher
    before the parent's own token). Returns why a matcher refused its token, else None."""
    old = list(group.seqs)
    taken: set[int] = set()
    chosen: list[tuple[Sequence, int, float]] = []
    for parent_idx, token, logprob in step.beams:
        parent = old[parent_idx] if group.forked else old[0]
        if id(parent) in taken:
            child = _fork(parent, len(chosen), group.seed, scheduler)
        else:
            taken.add(id(parent))
            child = parent
        chosen.append((child, token, logprob))
    for s in old:
        if id(s) not in taken:
            scheduler.finish(s, "beam_pruned")
    refused = None
    for i, (s, token, logprob) in enumerate(chosen):
        s.index = i
        s.token_ids.append(token)
        s.cumulative_logprob += logprob
        if s.constraint is not None and not s.constraint.consume(token) and refused is None:
            refused = f"beam {i}, output token {s.num_output_tokens - 1}: {s.constraint.error()}"
    group.seqs = [s for s, _, _ in chosen]
    group.forked = True
    return refused


def beam_step(group: SequenceGroup, rows: list[int], logits: torch.Tensor, *,
              structured: StructuredOutputs, scheduler: Scheduler, max_model_len: int
              ) -> Union[list[CoreOutput], GrammarError]:
    """Rank the continuations of a beam group's sequences (their logits ``rows``, in
    ``group.seqs`` order): fork and free beams and return nothing, or, when the search ended,
    free every beam and return one output each, best first. A matcher that refuses its
    token (or is broken) is returned as the GrammarError that ends the request."""
    logprobs = torch.log_softmax(logits[torch.tensor(rows, device=logits.device)].float(),
                                 dim=-1).cpu()
    masks, broken = structured.masks(group.seqs, logprobs.device)
    if broken:
        return GrammarError(broken[0].constraint.error() or "")
    if masks is not None:     # as transformers' logits processors: on the log-softmax
        logprobs[masks.rows] = logprobs[masks.rows].masked_fill(~masks.allowed, float("-inf"))
    beam = group.beam
    num_prompt = group.seqs[0].num_prompt_tokens
    at_limit = (beam.gen_len + 1 >= group.params.max_tokens
                or num_prompt + beam.gen_len + 1 >= max_model_len)
    step = beam.step(logprobs, length_limit=at_limit)
    if not step.done:
        refused = advance_beams(group, step, scheduler)
        return [] if refused is None else GrammarError(refused)
    group.finished_time = time.time()
    return beam_outputs(group, scheduler)


def beam_outputs(group: SequenceGroup, scheduler: Scheduler) -> list[CoreOutput]:
    """The finished search as one output per beam, best first, each its whole output (the
    output processor decodes it afresh); frees what the beams held."""
    num_prompt = group.seqs[0].num_prompt_tokens
    for s in list(group.seqs):
        scheduler.finish(s, "beam_done")
    results = group.beam.results()
    return [CoreOutput(group.request_id, rank, list(h.token_ids), list(h.logprobs), None,
                       "stop" if h.ended_on_eos else "length", None, num_prompt,
                       len(h.token_ids), h.cum_logprob, text_ends=h.ended_on_eos, whole=True,
                       ends_request=rank == len(results) - 1)
            for rank, h in enumerate(results)]
