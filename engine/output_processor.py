"""Output processing: one step's sampled tokens become deltas (vLLM's output processor).

Per sampled token: append it, advance its grammar matcher, apply the finish rules (stop token,
EOS past ``min_tokens``, ``max_tokens``, the model's length, stop strings found by the
detokenizer), detokenize the step's tokens in one pass, and free a choice that ended. Kept
apart from ``LLMEngine`` so the step reads as schedule -> forward -> sample -> process.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from tokenrelay.engine.detokenizer import detokenize_step
from tokenrelay.engine.grammar import GrammarError
from tokenrelay.engine.outputs import RequestDelta
from tokenrelay.engine.scheduler import Scheduler
from tokenrelay.engine.sequence import Sequence


class OutputProcessor:
    """Finish rules and deltas for the sampled (non-beam) rows of a step."""

    def __init__(self, scheduler: Scheduler, eos_token_ids: set[int], max_model_len: int) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def process(self, seqs: list[Sequence], sampled: Any, failed: dict[str, Exception],
                now: float, positions: Optional[list[int]] = None
                ) -> tuple[list[RequestDelta], list[str]]:
        """Append each sampled token, advance its matcher, check the finish conditions and
        detokenize. ``failed``: requests whose matcher broke (more are added here when a
        token breaks one); the caller ends them with an error delta. Returns the deltas and
        the ids of the requests whose last choice ended.

        With a constraint, EOS ends the choice even before ``min_tokens``: the sampler lets
        EOS through only when the grammar is complete and allows nothing else."""
        eos = self.eos_token_ids
        ended: list[str] = []
        for seq, tok in zip(seqs, sampled.token_ids):
            c = seq.constraint
            if c is not None and seq.request_id not in failed and not c.consume(tok):
                failed[seq.request_id] = GrammarError(f"output token {seq.num_output_tokens}: "
                                                      f"{c.error()}")
        if positions is None:
            positions = [-1] * len(seqs)
        if failed:
            keep = [i for i, s in enumerate(seqs) if s.request_id not in failed]
            seqs = [seqs[i] for i in keep]
            positions = [positions[i] for i in keep]
            sampled = type(sampled)(*[[getattr(sampled, f)[i] for i in keep]
                                      for f in ("token_ids", "logprobs", "top_logprobs")])
        finish: list[Optional[str]] = []
        stop_reasons: list[Union[str, int, None]] = []
        items = []
        sizes: list[int] = []
        for seq, tok, lp, top, pos in zip(seqs, sampled.token_ids, sampled.logprobs,
                                          sampled.top_logprobs, positions):
            p = seq.params
            if pos < 0:
                seq.token_ids.append(tok)
                num_tokens = len(seq.token_ids)
            else:
                seq.token_ids[pos] = tok
                num_tokens = pos + 1
            sizes.append(num_tokens)
            seq.cumulative_logprob += lp
            if p.logprobs is not None:
                seq.output_logprobs.append(top)
            if seq.first_token_time is None:
                seq.first_token_time = now
            n_out = num_tokens - seq.num_prompt_tokens
            reason: Optional[str] = None
            stop_reason: Union[str, int, None] = None
            text_tokens = [tok]
            if n_out >= p.min_tokens:
                if tok in p.stop_token_ids:
                    reason, stop_reason, text_tokens = "stop", tok, []
                elif not p.ignore_eos and tok in eos:
                    reason, text_tokens = "stop", []
            elif seq.constraint is not None and tok in eos:
                reason, text_tokens = "stop", []
            if reason is None and (n_out >= p.max_tokens or num_tokens >= self.max_model_len):
                reason = "length"
            finish.append(reason)
            stop_reasons.append(stop_reason)
            items.append((seq.detokenizer, text_tokens, reason is not None))
        texts = detokenize_step(items)
        deltas = []
        for seq, tok, lp, top, reason, stop_reason, (text, stop_str), num_tokens in zip(
                seqs, sampled.token_ids, sampled.logprobs, sampled.top_logprobs,
                finish, stop_reasons, texts, sizes):
            if stop_str is not None:
                reason, stop_reason = "stop", stop_str
            if reason is not None:
                del seq.token_ids[num_tokens:]      # a placeholder speculated past the end
                if self._finish_choice(seq, reason, stop_reason, now):
                    ended.append(seq.request_id)
            deltas.append(RequestDelta(
                request_id=seq.request_id,
                new_token_ids=[tok],
                new_text=text,
                logprobs=[top] if seq.params.logprobs is not None else None,
                token_logprobs=[lp],
                finished=reason is not None,
                finish_reason=reason,
                stop_reason=stop_reason,
                num_prompt_tokens=seq.num_prompt_tokens,
                num_output_tokens=num_tokens - seq.num_prompt_tokens,
                index=seq.index,
                cumulative_logprob=seq.cumulative_logprob,
            ))
        return deltas, ended

    def _finish_choice(self, seq: Sequence, reason: str, stop_reason: Union[str, int, None],
                       now: float) -> bool:
        """One choice ended: free what only it holds. True when it was the request's last."""
        seq.stop_reason = stop_reason
        seq.finished_time = now
        group = seq.group
        self.scheduler.finish(seq, reason)
        group.finished[seq.index] = seq
        return not group.seqs

