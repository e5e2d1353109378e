"""What must not change the tokens: prefix caching, chunking, preemption, batch company, resume."""

from __future__ import annotations

import random

import pytest

from tokenrelay.engine import LLM, SamplingParams
from tokenrelay.engine.llm_engine import LLMEngine
from tokenrelay.engine.outputs import ResumeState


pytestmark = pytest.mark.usefixtures("single_thread")


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def make_prompts(n: int = 32, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(5, 1000) for _ in range(40)]     # a common 40-token prefix
    prompts = []
    for i in range(n):
        own = [rng.randrange(5, 1000) for _ in range(rng.randrange(3, 90))]
        prompts.append(shared + own if i % 2 else own)
    return prompts


@pytest.fixture(scope="module")
def model_path(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def reference(model_path):
    llm = LLM(model_path, num_kv_blocks=1024, enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(make_prompts(), GREEDY)]


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_prefix_caching_does_not_change_tokens(model_path, reference):
    llm = LLM(model_path, num_kv_blocks=1024, enable_prefix_caching=True)
    assert tokens(llm.generate(make_prompts(), GREEDY)) == reference
    # Second pass: every prompt's full blocks are now cached.
    assert tokens(llm.generate(make_prompts(), GREEDY)) == reference
    assert llm.stats()["prefix_cache_hit_rate"] > 0.3


def test_small_token_budget_does_not_change_tokens(model_path, reference):
    llm = LLM(model_path, num_kv_blocks=1024, max_num_batched_tokens=16)
    assert tokens(llm.generate(make_prompts(), GREEDY)) == reference


def test_preemption_does_not_change_tokens(model_path, reference):
    llm = LLM(model_path, num_kv_blocks=24, block_size=8)
    assert tokens(llm.generate(make_prompts(), GREEDY)) == reference
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_used"] == 0


def test_alone_equals_together(model_path, reference):
    llm = LLM(model_path, num_kv_blocks=1024)
    prompts = make_prompts()
    for i in (0, 7, 31):
        assert tokens(llm.generate([prompts[i]], GREEDY)) == [reference[i]]


def test_seeded_sampling_ignores_batch_company(model_path):
    llm = LLM(model_path, num_kv_blocks=1024)
    prompts = make_prompts(16, seed=1)
    params = [SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i, max_tokens=20,
                             ignore_eos=True) for i in range(16)]
    together = llm.generate(prompts, params)
    for i in (0, 5, 15):
        alone = llm.generate([prompts[i]], params[i])[0]
        assert alone.outputs[0].token_ids == together[i].outputs[0].token_ids
        assert alone.outputs[0].text == together[i].outputs[0].text
    # And the seeds really sample: not every request equals greedy.
    greedy = tokens(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20,
                                                          ignore_eos=True)))
    assert tokens(together) != greedy


def run_to_end(engine: LLMEngine, rid: str, limit: int | None = None):
    ids, text = [], ""
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.request_id == rid:
                ids += d.new_token_ids
                text += d.new_text
                if d.finished or (limit is not None and len(ids) >= limit):
                    return ids, text, d
    raise AssertionError("request never finished")


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=7, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, stop=["e t"]),  # drawn seed
], ids=["greedy", "seeded", "drawn-seed"])
def test_resume_continues_exactly(model_path, params):
    prompt = "Once upon a time, in a quiet village"
    first = LLMEngine.from_kwargs(model=model_path, num_kv_blocks=256, seed=3)
    first.add_request("a", prompt, params)
    seed = first.request_seed("a")
    full_ids, full_text, _ = run_to_end(first, "a")

    part = LLMEngine.from_kwargs(model=model_path, num_kv_blocks=256, seed=3)
    part.add_request("a", prompt, params)
    head_ids, head_text, _ = run_to_end(part, "a", limit=11)
    part.abort_request("a")
    assert head_ids == full_ids[:11]

    other = LLMEngine.from_kwargs(model=model_path, num_kv_blocks=256, seed=99)
    other.add_request("noise", "unrelated company in the batch", SamplingParams(max_tokens=20))
    resumed = params.model_copy(update={"seed": seed})
    other.add_request("a2", prompt, resumed, resume=ResumeState(head_ids, head_text))
    tail_ids, tail_text, last = run_to_end(other, "a2")
    assert head_ids + tail_ids == full_ids
    assert head_text + tail_text == full_text
    assert last.num_output_tokens == len(full_ids)
