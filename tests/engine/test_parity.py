"""Greedy parity with transformers: same tokens, same logprobs, for every architecture.

The comparison itself lives in ``benchmarks/parity.py`` (the GPU check runs the same one on
CUDA): every prompt through ``LLM.generate`` in one batch (ragged, chunked, paged) and through
transformers' ``generate`` in one left-padded batch; float32 on both sides.
"""

from __future__ import annotations

import pytest

from benchmarks.parity import Divergence, ParityResult, greedy_parity

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_matches_transformers(tiny_checkpoint, arch):
    result = greedy_parity(str(tiny_checkpoint(arch)), device="cpu")
    assert result.ok, result.describe()
    assert result.tokens_equal and result.prompt_ids_equal and result.finish_reasons_ok
    assert result.max_logprob_diff < 1e-4 and result.max_cumulative_diff < 1e-3


def test_a_divergence_fails_the_comparison_and_says_where():
    r = ParityResult(model="m", device="cpu", prompts=2, new_tokens=4)
    assert r.ok
    r.divergences.append(Divergence(prompt=1, position=3, ours=7, theirs=8, top2_gap=2e-7))
    assert not r.ok and "prompt 1 diverges at token 3" in r.describe()
