"""The GPU check's engine sections where a CPU can judge them: the bf16 CUDA-graph verdict
(benchmarks.gpu_engine_sections._explained) and the 1.1B checkpoint's shape. The sections
themselves run in the GPU check's dry run (tests/benchmarks/test_gpu_check.py)."""

from __future__ import annotations

import pytest

from benchmarks.gpu_engine_sections import _explained, _shape_spread
from tokenrelay.engine.outputs import CompletionOutput

pytestmark = pytest.mark.timeout(60)
BF16_LOGPROB_TOL = 0.1             # any tolerance: the rule is what these tests judge


def out(tokens: list[int], logprobs: list[dict[int, float]]) -> CompletionOutput:
    return CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None,
                            logprobs=logprobs)


def test_equal_tokens_with_close_logprobs_pass_and_report_the_largest_difference():
    eager = out([5, 6], [{5: -0.10, 9: -2.0}, {6: -0.50, 2: -1.5}])
    graph = out([5, 6], [{5: -0.12, 9: -2.0}, {6: -0.47, 2: -1.5}])
    ok, worst = _explained(graph, eager, BF16_LOGPROB_TOL)
    assert ok and worst == pytest.approx(0.03)


def test_a_logprob_past_the_tolerance_fails():
    eager = out([5], [{5: -0.1, 9: -3.0}])
    graph = out([5], [{5: -0.1 - 2 * BF16_LOGPROB_TOL, 9: -3.0}])
    assert not _explained(graph, eager, BF16_LOGPROB_TOL)[0]


def test_a_different_token_passes_only_where_eager_top_two_were_close():
    close = out([5, 7], [{5: -0.1, 1: -3.0}, {7: -0.70, 8: -0.72}])
    far = out([5, 7], [{5: -0.1, 1: -3.0}, {7: -0.1, 8: -2.5}])
    graph = out([5, 8], [{5: -0.1, 1: -3.0}, {8: -0.71, 7: -0.71}])
    assert _explained(graph, close, BF16_LOGPROB_TOL)[0]
    assert not _explained(graph, far, BF16_LOGPROB_TOL)[0]


def test_the_shape_spread_is_the_largest_difference_before_each_divergence():
    eager8 = [out([5, 6], [{5: -0.10}, {6: -0.50}]), out([3, 4], [{3: -1.0}, {4: -0.2}])]
    eager6 = [out([5, 6], [{5: -0.14}, {6: -0.50}]), out([3, 9], [{3: -1.02}, {9: -3.0}])]
    assert _shape_spread(eager8, eager6) == pytest.approx(0.04)


def test_the_1b_size_has_tinyllamas_shape():
    from tokenrelay.engine import tiny
    cfg = tiny.make_config("llama", size="1b")
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
            cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
            cfg["vocab_size"]) == (2048, 5632, 22, 32, 4, 64, 32000)
    h, i, v = 2048, 5632, 32000
    per_layer = h * 32 * 64 + 2 * h * 4 * 64 + 32 * 64 * h + 3 * h * i + 2 * h
    params = 22 * per_layer + 2 * v * h + h
    assert 1.0e9 < params < 1.2e9
