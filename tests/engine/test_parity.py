"""Greedy parity with transformers: same tokens, same logprobs, for every architecture.

Every prompt runs through ``LLM.generate`` in one batch (ragged, chunked, paged) and through
transformers' ``generate`` in one left-padded batch; float32 on both sides.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams


pytestmark = pytest.mark.usefixtures("single_thread")


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


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_matches_transformers(tiny_checkpoint, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_checkpoint(arch)
    # A small token budget forces chunked prefill of the longer prompts as well.
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params)

    tok = AutoTokenizer.from_pretrained(str(path), padding_side="left")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        gen = hf.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=tok.pad_token_id,
                          output_scores=True, return_dict_in_generate=True)
    width = enc.input_ids.shape[1]
    for row, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        mask = enc.attention_mask[row].bool()
        assert out.prompt_token_ids == enc.input_ids[row][mask].tolist()
        ref = gen.sequences[row, width:].tolist()
        got = out.outputs[0].token_ids
        assert got == ref, f"{arch}: token mismatch for prompt {prompt[:30]!r}"
        assert out.outputs[0].finish_reason == "length"
        ref_lp = [torch.log_softmax(s[row].float(), -1)[t].item()
                  for s, t in zip(gen.scores, ref)]
        got_lp = [d[t] for d, t in zip(out.outputs[0].logprobs, got)]
        worst = max(abs(a - b) for a, b in zip(got_lp, ref_lp))
        assert worst < 1e-4, f"{arch}: logprob off by {worst}"
        assert abs(out.outputs[0].cumulative_logprob - sum(ref_lp)) < 1e-3
