"""The step's attention plan: built once per step by the ModelRunner and used by every layer,
equal to a plan built per call, and refused when it belongs to another batch."""

from __future__ import annotations

import pytest
import torch

from tokenrelay.engine import LLM, SamplingParams
from tokenrelay.engine.layers import attention
from tokenrelay.engine.layers.attention_plan import AttentionPlan

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_the_runner_builds_one_plan_per_step_for_all_layers(tiny_checkpoint, monkeypatch,
                                                            enforce_eager):
    llm = LLM(str(tiny_checkpoint("llama")), num_kv_blocks=64, max_model_len=256,
              max_num_batched_tokens=24, enforce_eager=enforce_eager)
    assert len(llm.engine.model_runner.model.model.layers) >= 2
    built: list[AttentionPlan] = []
    seen: set[int] = set()
    for_step = AttentionPlan.for_step.__func__

    def counting(cls, *args):
        plan = for_step(cls, *args)
        built.append(plan)
        return plan

    def groups(self, _orig=AttentionPlan.eager_groups):
        seen.add(id(self))
        return _orig(self)

    monkeypatch.setattr(AttentionPlan, "for_step", classmethod(counting))
    monkeypatch.setattr(AttentionPlan, "eager_groups", groups)
    steps = llm.stats()["num_steps"]
    # Two prompts and a 24-token budget: chunked prefill mixed with decodes, then decodes.
    outs = llm.generate([[5] * 30, [9] * 7], SamplingParams(max_tokens=6, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]
    assert len(built) == llm.stats()["num_steps"] - steps     # one plan a step, not one a layer
    if enforce_eager:
        assert seen and seen <= {id(p) for p in built}        # layers used the runner's plans


def _batch(lens: list[int], block_size: int = 4, hq: int = 4, hkv: int = 2, d: int = 8):
    gen = torch.Generator().manual_seed(len(lens))
    need = [-(-n // block_size) for n in lens]
    k_cache = torch.randn(sum(need) + 2, block_size, hkv, d, generator=gen)
    v_cache = torch.randn_like(k_cache)
    tables = torch.zeros(len(lens), max(need), dtype=torch.int32)
    perm = torch.randperm(k_cache.shape[0], generator=gen).tolist()
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor([perm.pop() for _ in range(n)])
    q = torch.randn(len(lens), hq, d, generator=gen)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


def test_a_given_plan_gives_what_a_plan_built_per_call_gives():
    q, k_cache, v_cache, tables, seq_lens = _batch([9, 3, 16, 1, 12])
    plan = AttentionPlan.for_step(tables, seq_lens, None, 4, q.dtype)
    given = attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.3,
                                             plan=plan)
    built = attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.3)
    torch.testing.assert_close(given, built, rtol=0, atol=0)


def test_a_plan_of_another_batch_is_refused():
    q, k_cache, v_cache, tables, seq_lens = _batch([9, 3, 16])
    other = AttentionPlan.for_step(tables[:2], seq_lens[:2], None, 4, q.dtype)
    with pytest.raises(ValueError, match="plan is for 2 sequences"):
        attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.3, plan=other)
    wrong_blocks = AttentionPlan.for_step(tables, seq_lens, None, 8, q.dtype)
    with pytest.raises(ValueError, match="blocks of 8"):
        attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.3,
                                         plan=wrong_blocks)
    wrong_dtype = AttentionPlan.for_step(tables, seq_lens, None, 4, torch.float64)
    with pytest.raises(ValueError, match="torch.float64"):
        attention.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.3,
                                         plan=wrong_dtype)
