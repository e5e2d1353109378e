"""End to end: the engine on the "triton" backend (interpreter on CPU) generates exactly what
transformers does.

Kept small (two prompts, 8 new tokens, float32) because every op runs interpreted. A tight token
budget splits the longer prompt into chunks, so prefill with a cached prefix (context_len > 0),
decode with split-K defaults and every pointwise kernel all run inside the real decoder.
"""

from __future__ import annotations

import pytest
import torch

from tokenrelay.engine import LLM, SamplingParams

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


def test_decode_graph_runner_padding_matches_eager(tiny_checkpoint):
    """The CUDA-graph path's static buffers and padding (batch 3 -> 4, then 2, then 1 as requests
    finish), with replay standing in for an eager forward since CUDA graphs need a GPU."""
    from tokenrelay.engine.layers.cuda_graphs import DecodeGraphRunner, capture_sizes

    class EagerReplay(DecodeGraphRunner):
        replays = 0

        def _record(self, size):
            cfg = self.model.config
            out = torch.empty(size, cfg.hidden_size, dtype=self.model.dtype)

            def replay():
                EagerReplay.replays += 1
                out.copy_(self._forward(size))
            return replay, out

    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32]
    path = str(tiny_checkpoint("llama"))
    kw = dict(dtype="float32", device="cpu", max_num_seqs=4, max_model_len=64, num_kv_blocks=32)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 3, 2)]
    prompts = [*PROMPTS, "1 2 3"]
    want = [o.outputs[0].token_ids for o in LLM(path, attention_backend="torch", **kw).generate(prompts, params)]

    llm = LLM(path, attention_backend="triton", **kw)
    runner = llm.engine.model_runner
    runner.decode_graphs = EagerReplay(runner.model, runner.kv_caches, 4, 4, runner.device)
    runner.decode_graphs.capture()
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert EagerReplay.replays == 3          # decode steps: batch 3 (padded to 4), 2, 1
