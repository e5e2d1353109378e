"""End to end: the engine on the "triton" backend (interpreter on CPU) generates exactly what
transformers does.

Kept small (two prompts, 8 new tokens, float32) because every op runs interpreted. A tight token
budget splits the longer prompt into chunks, so prefill with a cached prefix (context_len > 0),
decode with split-K defaults and every pointwise kernel all run inside the real decoder.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog, then naps in the warm sun."]
NEW_TOKENS = 8


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_backend_greedy_matches_transformers(tiny_checkpoint, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(tiny_checkpoint(arch))
    llm = LLM(path, dtype="float32", device="cpu", attention_backend="triton",
              max_num_batched_tokens=12, num_kv_blocks=32)
    assert llm.engine.model_runner.model.ops.name == "triton"
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(PROMPTS, params)

    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, outs):
        enc = tok(prompt, return_tensors="pt")
        with torch.no_grad():
            gen = hf.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=tok.pad_token_id, output_scores=True,
                              return_dict_in_generate=True)
        ref = gen.sequences[0, enc.input_ids.shape[1]:].tolist()
        got = out.outputs[0].token_ids
        assert got == ref, f"{arch}: token mismatch for prompt {prompt[:30]!r}"
        ref_lp = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(gen.scores, ref)]
        got_lp = [d[t] for d, t in zip(out.outputs[0].logprobs, got)]
        assert max(abs(a - b) for a, b in zip(got_lp, ref_lp)) < 1e-4
