"""Parallel sampling (``n > 1``): one prefill, shared blocks, copy on write, exact choices.

Choice i of an n-way request with seed s draws with ``branch_seed(s, i)``; a request with
``n = 1`` and that seed, run alone, is the reference: the same tokens and the same logprobs
prove that no choice ever read another's KV (they diverge inside the shared partial block).
"""

from __future__ import annotations

import pytest

from tokenrelay.engine import InvalidRequestError, PromptTooLongError, SamplingParams
from tokenrelay.engine.forks import branch_seed
from tokenrelay.engine.outputs import ResumeState

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = list(range(40, 50))        # 10 tokens: 2 full blocks of 4 and a shared partial one


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


def make_llm(path, **kw):
    from tokenrelay.engine import LLM
    kw.setdefault("num_kv_blocks", 128)
    kw.setdefault("block_size", 4)
    return LLM(path, **kw)


def sampled(n: int, seed: int = 11, max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(n=n, seed=seed, temperature=1.0, max_tokens=max_tokens,
                          ignore_eos=True, logprobs=0, **kw)


def test_each_choice_is_its_seed_run_alone(path):
    llm = make_llm(path)
    out = llm.generate({"prompt_token_ids": PROMPT}, sampled(4))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 4
    for c in out.outputs:
        alone = make_llm(path).generate(
            {"prompt_token_ids": PROMPT},
            sampled(1, seed=branch_seed(11, c.index)))[0].outputs[0]
        assert c.token_ids == alone.token_ids
        assert c.cumulative_logprob == pytest.approx(alone.cumulative_logprob, abs=1e-4)
        assert c.text == alone.text
    assert out.outputs[0].token_ids == llm.generate({"prompt_token_ids": PROMPT},
                                                    sampled(1))[0].outputs[0].token_ids
    assert llm.stats()["kv_blocks_used"] == 0
    assert all(rc == 0 for rc in llm.engine.block_manager.ref_counts)


def test_choices_do_not_depend_on_batching_or_chunking(path):
    ref = make_llm(path).generate({"prompt_token_ids": PROMPT * 3}, sampled(3))[0]
    llm = make_llm(path, max_num_batched_tokens=8, max_num_seqs=8)
    others = [{"prompt_token_ids": list(range(60 + i, 75 + i))} for i in range(3)]
    outs = llm.generate([*others, {"prompt_token_ids": PROMPT * 3}],
                        [sampled(1, seed=i) for i in range(3)] + [sampled(3)])
    assert [c.token_ids for c in outs[-1].outputs] == [c.token_ids for c in ref.outputs]


def test_blocks_in_use_are_the_prompt_once_plus_each_choices_own(path):
    from tokenrelay.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_kwargs(model=path, num_kv_blocks=128, block_size=4)
    bm = engine.block_manager
    prompt = list(range(40, 61))    # 21 tokens: 5 full blocks, 1 partial
    engine.add_request("r", prompt, sampled(4, max_tokens=16))
    group = engine.requests["r"]
    engine.step()                   # prefill once, fork, first token of each choice
    assert bm.num_used_blocks == 6 and len(group.seqs) == 4
    assert all(s.block_table == group.seqs[0].block_table for s in group.seqs)
    steps = 1
    while "r" in engine.requests:
        engine.step()
        steps += 1
        if "r" not in engine.requests:
            break
        tables = [s.block_table for s in group.seqs]
        assert all(t[:5] == tables[0][:5] for t in tables)
        own = sum(len(t) - 5 for t in tables)
        assert bm.num_used_blocks == 5 + own            # each copied the partial block once
        assert own == sum(bm.blocks_for(s.num_computed_tokens) - 5 for s in group.seqs)
    assert steps == 16
    assert bm.num_used_blocks == 0 and all(rc == 0 for rc in bm.ref_counts)


def test_preempted_group_recomputes_to_the_same_choices(path):
    ref = make_llm(path).generate({"prompt_token_ids": PROMPT}, sampled(3, max_tokens=20))[0]
    llm = make_llm(path, num_kv_blocks=20, max_num_seqs=6)
    engine = llm.engine
    engine.add_request("urgent", list(range(100, 140)),
                       SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0),
                       priority=-1)
    out = llm.generate({"prompt_token_ids": PROMPT}, sampled(3, max_tokens=20))[0]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["num_preemptions"] > 0
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
    assert engine.stats()["kv_blocks_used"] == 0


def test_abort_frees_every_choice(path):
    from tokenrelay.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_kwargs(model=path, num_kv_blocks=64, block_size=4)
    engine.add_request("r", PROMPT, sampled(3, max_tokens=30))
    for _ in range(5):
        engine.step()
    assert engine.block_manager.num_used_blocks > 3
    assert engine.abort_request("r")
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_prefix_cache_still_serves_a_second_request(path):
    llm = make_llm(path)
    llm.generate({"prompt_token_ids": PROMPT * 2}, sampled(2))
    llm.generate({"prompt_token_ids": PROMPT * 2}, sampled(2, seed=3))
    assert llm.stats()["prefix_cache_hit_tokens"] >= 16


def test_step_deltas_are_per_choice_and_each_choice_ends_once(path):
    from tokenrelay.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_kwargs(model=path, num_kv_blocks=64, block_size=4)
    engine.add_request("r", PROMPT, SamplingParams(n=3, seed=5, temperature=1.0, max_tokens=6,
                                                   ignore_eos=True))
    ended: list[int] = []
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    while engine.has_unfinished_requests():
        deltas = engine.step()
        assert len({d.index for d in deltas}) == len(deltas)
        for d in deltas:
            tokens[d.index] += d.new_token_ids
            assert d.num_output_tokens == len(tokens[d.index])
            if d.finished:
                ended.append(d.index)
    assert sorted(ended) == [0, 1, 2]
    assert all(len(t) == 6 for t in tokens.values())


def test_resume_continues_each_choice_from_what_was_delivered(path):
    """A worker that takes over gives each choice what the client already has; a finished
    choice is not run again, and the others continue exactly."""
    from tokenrelay.engine.llm_engine import LLMEngine

    def run(resume=None, params=None):
        engine = LLMEngine.from_kwargs(model=path, num_kv_blocks=64, block_size=4)
        engine.add_request("r", PROMPT, params, resume=resume)
        got: dict[int, list] = {}
        while engine.has_unfinished_requests():
            for d in engine.step():
                got.setdefault(d.index, []).append(d)
        return got

    params = SamplingParams(n=3, seed=9, temperature=1.0, max_tokens=10, ignore_eos=True)
    full = run(params=params)
    cut = {0: 4, 1: 0}
    states = []
    for i in range(3):
        ds = full[i][:cut.get(i, 10)]
        st = ResumeState([t for d in ds for t in d.new_token_ids], "".join(d.new_text for d in ds))
        if i == 2:
            st.finish_reason = "length"
        states.append(st)
    resumed = run(states, params)
    assert sorted(resumed) == [0, 1]
    for i in (0, 1):
        assert [d.new_token_ids for d in resumed[i]] == [d.new_token_ids for d in full[i][cut[i]:]]
        assert "".join(d.new_text for d in resumed[i]) == "".join(
            d.new_text for d in full[i][cut[i]:])


def test_bounds_and_pool_errors_name_the_field(path):
    from tokenrelay.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_kwargs(model=path, num_kv_blocks=16, block_size=4, max_n=4,
                                   max_num_seqs=8)
    with pytest.raises(InvalidRequestError, match="n: 5 exceeds this engine's limit of 4"):
        engine.add_request("a", PROMPT, SamplingParams(n=5))
    with pytest.raises(PromptTooLongError, match="n: 4 choices"):
        engine.add_request("b", PROMPT, SamplingParams(n=4, max_tokens=40))
    small = LLMEngine.from_kwargs(model=path, num_kv_blocks=64, block_size=4, max_num_seqs=2)
    with pytest.raises(InvalidRequestError, match="max_num_seqs=2"):
        small.add_request("c", PROMPT, SamplingParams(n=3))
    with pytest.raises(InvalidRequestError, match="resume: expected 2"):
        engine.add_request("d", PROMPT, SamplingParams(n=2), resume=ResumeState([], ""))
    assert not engine.requests and not small.requests
