"""Beam search: which continuations of a request's beams survive each step.

The ranking is Hugging Face transformers' ``generate(num_beams=k, do_sample=False,
early_stopping=True)``, step for step, so the same checkpoint gives the same beams in the same
order: each step takes the top ``keep = max(2, 1 + #eos) * k`` continuations of all beams by
cumulative log-probability; the best k that do not end become the next beams, and those of the
first k that end (an EOS token, or the length limit) join the k finished hypotheses, scored
``cum_logprob / generated_len ** length_penalty``. The search ends when k hypotheses are
finished (early stopping), when no running beam can still beat the worst finished one, or when
every continuation ends. The arithmetic mirrors transformers' tensors (float32, the same -1e9
masks), because any other formula reorders near-ties.

This module only ranks. ``LLMEngine._beam_step`` asks it for each step's decisions and
``engine/forks.py`` (``advance_beams``) carries them out: a beam chosen twice forks on its
parent's blocks (copy on write), beams nobody continues are freed, and ``beam_outputs`` reports
the finished beams, best first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

_MASK = -1.0e9


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``LLM.beam_search(prompts, BeamSearchParams(...))``."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    min_tokens: int = 0


@dataclass
class BeamSearchSequence:
    """One finished beam: its generated tokens (EOS included when it ended on one)."""

    token_ids: list[int]
    text: str
    cum_logprob: float
    score: float                        # cum_logprob / len(token_ids) ** length_penalty
    finish_reason: str                  # "stop" (EOS) or "length"
    logprobs: list[float] = field(default_factory=list)   # of each chosen token


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt: Optional[str] = None


@dataclass
class Hypothesis:
    token_ids: list[int]
    logprobs: list[float]
    cum_logprob: float
    score: float
    ended_on_eos: bool


@dataclass
class BeamStep:
    """What one step decided: the next beams as (parent beam, token, token logprob), and
    whether the search is over."""

    beams: list[tuple[int, int, float]]
    done: bool


class BeamSearch:
    """The ranking state of one request's beam search (see the module docstring)."""

    def __init__(self, width: int, *, length_penalty: float, eos_token_ids: list[int],
                 ignore_eos: bool, max_tokens: int, min_tokens: int = 0) -> None:
        self.k = width
        self.length_penalty = length_penalty
        self.eos = sorted(set(eos_token_ids))
        self.ignore_eos = ignore_eos
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.keep = max(2, 1 + len(self.eos)) * width
        self.gen_len = 0
        # Running beams: cumulative scores (with transformers' -1e9 offsets) and histories.
        self.running_scores = torch.full((width,), _MASK, dtype=torch.float32)
        self.running_scores[0] = 0.0
        self.running: list[tuple[list[int], list[float]]] = [([], [])] * width
        # Finished hypotheses: k slots, sorted by score (unfilled slots score -1e9).
        self.finished_scores = torch.full((width,), _MASK, dtype=torch.float32)
        self.finished_flags = torch.zeros(width, dtype=torch.bool)
        self.finished: list[Optional[Hypothesis]] = [None] * width
        self.can_improve = True
        self.done = False

    def step(self, logprobs: torch.Tensor, *, length_limit: bool) -> BeamStep:
        """Rank the continuations of the running beams.

        ``logprobs``: [beams, vocab] log-softmax of each running beam's next-token logits (one
        row at the first step, when every beam is still the prompt). ``length_limit``: the next
        token reaches max_tokens or max_model_len, so every continuation ends.
        """
        k, vocab = self.k, logprobs.shape[-1]
        lp = logprobs.float()
        if lp.shape[0] == 1 and k > 1:
            lp = lp.expand(k, vocab)
        lp = lp.clone()
        if self.eos and self.gen_len < self.min_tokens and not self.ignore_eos:
            lp[:, self.eos] = float("-inf")
        acc = (lp + self.running_scores[:, None]).reshape(-1)
        top_vals, top_idx = torch.topk(acc, self.keep)
        parents = (top_idx // vocab).tolist()
        tokens = (top_idx % vocab).tolist()
        hits = torch.tensor([length_limit or (not self.ignore_eos and t in self.eos)
                             for t in tokens], dtype=torch.bool)
        token_lps = lp.reshape(-1)[top_idx].tolist()

        # e. the next running beams: the best continuations that do not end
        masked = top_vals + hits.to(torch.float32) * _MASK
        nxt = torch.topk(masked, k).indices.tolist()
        new_running = [(self.running[parents[i]][0] + [tokens[i]],
                        self.running[parents[i]][1] + [token_lps[i]]) for i in nxt]
        beams = [(parents[i], tokens[i], token_lps[i]) for i in nxt]

        # f. finished hypotheses: those of the first k continuations that end
        self._add_finished(top_vals, hits, parents, tokens, token_lps)
        self.running_scores = masked[nxt]
        self.running = new_running
        self.gen_len += 1

        # g. stop?
        best_running = self.running_scores[:1] / (self.gen_len ** self.length_penalty)
        worst = torch.where(self.finished_flags, self.finished_scores.min(),
                            torch.tensor(_MASK))
        self.can_improve = self.can_improve and bool(torch.any(best_running > worst))
        self.done = (not self.can_improve or bool(self.finished_flags.all())
                     or bool(hits.all()))
        return BeamStep(beams, self.done)

    def _add_finished(self, top_vals: torch.Tensor, hits: torch.Tensor, parents: list[int],
                      tokens: list[int], token_lps: list[float]) -> None:
        k = self.k
        in_top = torch.arange(self.keep) < k
        just_finished = hits & in_top
        scores = top_vals / ((self.gen_len + 1) ** self.length_penalty)
        if bool(self.finished_flags.all()):          # early stopping: k hypotheses are enough
            scores = scores + _MASK
        if not self.can_improve:
            scores = scores + _MASK
        scores = scores + (~just_finished).to(torch.float32) * _MASK
        merged = torch.cat((self.finished_scores, scores))
        flags = torch.cat((self.finished_flags, just_finished))
        order = torch.topk(merged, k).indices.tolist()
        slots: list[Optional[Hypothesis]] = []
        for j in order:
            if j < k:
                slots.append(self.finished[j])
                continue
            c = j - k
            toks, lps = self.running[parents[c]]
            slots.append(Hypothesis(toks + [tokens[c]], lps + [token_lps[c]],
                                    float(top_vals[c]), float(merged[j]),
                                    tokens[c] in self.eos and not self.ignore_eos))
        self.finished = slots
        self.finished_scores = merged[order]
        self.finished_flags = flags[order]

    def results(self) -> list[Hypothesis]:
        """The k finished hypotheses, best first (the search must be done)."""
        if not self.done:
            raise RuntimeError("beam search results asked for before the search ended")
        return [h for h in self.finished if h is not None]
