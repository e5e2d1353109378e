"""The engine core's half of output processing: one step's sampled tokens appended, their
matchers advanced, and the finish rules that need no text applied (stop token, EOS past
``min_tokens``, ``max_tokens``, the model's length). The result is ids only
(``CoreOutput``); text, stop strings and deltas are the output processor's
(engine/output_processor.py), which may run in another process (engine/core_client.py).

A choice that ends here is freed at once; one that a stop string ends is freed when the
output processor says so (``EngineCore.finish_choice``), a step or two later across
processes: its extra tokens are dropped there, so what a client sees is the same.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from tokenrelay.engine.grammar import GrammarError
from tokenrelay.engine.outputs import CoreOutput
from tokenrelay.engine.scheduler import Scheduler
from tokenrelay.engine.sequence import Sequence


class FinishRules:
    """Appends the sampled (non-beam) rows of a step and ends the choices that are done."""

    def __init__(self, scheduler: Scheduler, eos_token_ids: set[int], max_model_len: int) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def process(self, seqs: list[Sequence], sampled: Any, failed: dict[str, Exception],
                now: float, positions: Optional[list[int]] = None
                ) -> tuple[list[CoreOutput], list[str]]:
        """Append each sampled token (or fill its placeholder at ``positions``), advance its
        matcher and check the finish conditions. ``failed``: requests whose matcher broke
        (more are added here when a token breaks one); the caller ends them with an error.
        Returns the outputs and the ids of the requests whose last choice ended.

        With a constraint, EOS ends the choice even before ``min_tokens``: the sampler lets
        EOS through only when the grammar is complete and allows nothing else."""
        for seq, tok in zip(seqs, sampled.token_ids):
            c = seq.constraint
            if c is not None and seq.request_id not in failed and not c.consume(tok):
                failed[seq.request_id] = GrammarError(f"output token {seq.num_output_tokens}: "
                                                      f"{c.error()}")
        if positions is None:
            positions = [-1] * len(seqs)
        ended: list[str] = []
        outs: list[CoreOutput] = []
        eos = self.eos_token_ids
        for seq, tok, lp, top, pos in zip(seqs, sampled.token_ids, sampled.logprobs,
                                          sampled.top_logprobs, positions):
            if failed and seq.request_id in failed:
                continue
            p = seq.params
            if pos < 0:
                seq.token_ids.append(tok)
                num_tokens = len(seq.token_ids)
            else:
                seq.token_ids[pos] = tok
                num_tokens = pos + 1
            if lp is not None:
                seq.cumulative_logprob += lp
                seq.output_logprobs.append(top)
            if seq.first_token_time is None:
                seq.first_token_time = now
            n_out = num_tokens - seq.num_prompt_tokens
            reason: Optional[str] = None
            stop_reason: Union[str, int, None] = None
            if n_out >= p.min_tokens:
                if tok in p.stop_token_ids:
                    reason, stop_reason = "stop", tok
                elif not p.ignore_eos and tok in eos:
                    reason = "stop"
            elif seq.constraint is not None and tok in eos:
                reason = "stop"
            text_ends = reason is not None
            if reason is None and (n_out >= p.max_tokens or num_tokens >= self.max_model_len):
                reason = "length"
            last = False
            if reason is not None:
                del seq.token_ids[num_tokens:]      # a placeholder speculated past the end
                last = finish_choice(self.scheduler, seq, reason, stop_reason, now)
                if last:
                    ended.append(seq.request_id)
            asked = lp is not None
            outs.append(CoreOutput(
                seq.request_id, seq.index, [tok], [lp] if asked else [],
                [top] if asked else None, reason, stop_reason, seq.num_prompt_tokens, n_out,
                seq.cumulative_logprob if asked else None, text_ends, False, last))
        return outs, ended


def finish_choice(scheduler: Scheduler, seq: Sequence, reason: str,
                  stop_reason: Union[str, int, None], now: float) -> bool:
    """One choice ended: free what only it holds. True when it was the request's last."""
    seq.stop_reason = stop_reason
    seq.finished_time = now
    group = seq.group
    scheduler.finish(seq, reason)
    group.finished[seq.index] = seq
    return not group.seqs
