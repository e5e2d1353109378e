"""Greedy parity of our engine with transformers: same tokens, same logprobs.

One home for the comparison that ``tests/engine/test_parity.py`` runs on CPU for every
architecture and ``benchmarks.gpu_check`` runs on CUDA. Every prompt goes through
``LLM.generate`` in one batch (ragged, chunked with a small token budget, paged) and through
transformers' ``generate`` in one left-padded batch, float32 on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "你好，世界！请告诉我今天的天气怎么样。",
    "Once upon a time, in a land far, far away, there lived a small dragon who loved books.",
    "1 2 3 4 5 6 7 8 9 10 11 12",
    "A " * 60,
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "The history of the printing press begins " + "with movable type and ink, " * 8,
]
NEW_TOKENS = 32
LOGPROB_TOLERANCE = 1e-4
CUMULATIVE_TOLERANCE = 1e-3


@dataclass
class Divergence:
    """Where one prompt's tokens first differ, and how close transformers' top two were there
    (a gap near 0 is a tie that rounding may break either way)."""

    prompt: int
    position: int
    ours: int
    theirs: int
    top2_gap: float


@dataclass
class ParityResult:
    model: str
    device: str
    prompts: int
    new_tokens: int
    prompt_ids_equal: bool = True
    finish_reasons_ok: bool = True
    divergences: list[Divergence] = field(default_factory=list)
    max_logprob_diff: float = 0.0
    max_cumulative_diff: float = 0.0

    @property
    def tokens_equal(self) -> bool:
        return not self.divergences

    @property
    def ok(self) -> bool:
        return (self.prompt_ids_equal and self.finish_reasons_ok and self.tokens_equal
                and self.max_logprob_diff < LOGPROB_TOLERANCE
                and self.max_cumulative_diff < CUMULATIVE_TOLERANCE)

    def describe(self) -> str:
        head = (f"{self.model} on {self.device}: {self.prompts} prompts x {self.new_tokens} "
                f"tokens, ")
        if self.ok:
            return head + f"identical tokens, logprobs within {self.max_logprob_diff:.1e}"
        parts = []
        if not self.prompt_ids_equal:
            parts.append("prompt token ids differ")
        if not self.finish_reasons_ok:
            parts.append("a finish reason is not 'length'")
        for d in self.divergences:
            parts.append(f"prompt {d.prompt} diverges at token {d.position} (ours {d.ours}, "
                         f"transformers {d.theirs}, their top-2 gap {d.top2_gap:.2e})")
        parts.append(f"max logprob diff {self.max_logprob_diff:.2e}")
        return head + "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {"model": self.model, "device": self.device, "prompts": self.prompts,
                "new_tokens": self.new_tokens, "ok": self.ok,
                "prompt_ids_equal": self.prompt_ids_equal,
                "finish_reasons_ok": self.finish_reasons_ok,
                "divergences": [vars(d) for d in self.divergences],
                "max_logprob_diff": self.max_logprob_diff,
                "max_cumulative_diff": self.max_cumulative_diff}


def greedy_parity(path: str, device: str = "cpu", prompts: Optional[list[str]] = None,
                  new_tokens: int = NEW_TOKENS, **engine_kw: Any) -> ParityResult:
    """Run both engines greedily on ``prompts`` and compare token by token. A small token
    budget (``max_num_batched_tokens=64`` unless given) forces chunked prefill of the longer
    prompts as well."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tokenrelay.engine import LLM, SamplingParams

    prompts = list(prompts or PROMPTS)
    engine_kw.setdefault("max_num_batched_tokens", 64)
    llm = LLM(str(path), dtype="float32", device=device, **engine_kw)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    del llm

    tok = AutoTokenizer.from_pretrained(str(path), padding_side="left")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
    enc = tok(prompts, return_tensors="pt", padding=True).to(device)
    with torch.no_grad():
        gen = hf.generate(**enc, max_new_tokens=new_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=tok.pad_token_id,
                          output_scores=True, return_dict_in_generate=True)
    result = ParityResult(model=str(path), device=device, prompts=len(prompts),
                          new_tokens=new_tokens)
    width = enc.input_ids.shape[1]
    for row, out in enumerate(outs):
        _compare_row(result, row, out, enc, gen, width)
    return result


def _compare_row(result: ParityResult, row: int, out: Any, enc: Any, gen: Any,
                 width: int) -> None:
    mask = enc.attention_mask[row].bool()
    result.prompt_ids_equal &= out.prompt_token_ids == enc.input_ids[row][mask].tolist()
    ref = gen.sequences[row, width:].tolist()
    choice = out.outputs[0]
    got = choice.token_ids
    result.finish_reasons_ok &= choice.finish_reason == "length"
    logprobs = [torch.log_softmax(s[row].float(), -1) for s in gen.scores]
    if got != ref:
        pos = next(i for i, (a, b) in enumerate(zip(got + [-1], ref + [-2])) if a != b)
        gap = float("nan")
        if pos < len(logprobs):
            top = torch.topk(logprobs[pos], 2).values
            gap = float(top[0] - top[1])
        result.divergences.append(Divergence(row, pos, got[pos] if pos < len(got) else -1,
                                             ref[pos] if pos < len(ref) else -1, gap))
        return
    ref_lp = [lp[t].item() for lp, t in zip(logprobs, ref)]
    got_lp = [d[t] for d, t in zip(choice.logprobs, got)]
    worst = max((abs(a - b) for a, b in zip(got_lp, ref_lp)), default=0.0)
    result.max_logprob_diff = max(result.max_logprob_diff, worst)
    result.max_cumulative_diff = max(result.max_cumulative_diff,
                                     abs(choice.cumulative_logprob - sum(ref_lp)))
