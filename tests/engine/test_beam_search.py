"""Beam search against transformers' ``generate(num_beams=k, early_stopping=True)``.

The same sequences in the same order and scores within 1e-4, on tiny checkpoints whose EOS set
is widened so that beams end on EOS at different lengths (the paths of finished hypotheses,
early stopping and the 3k-candidate window of two EOS ids all run), and without it (every beam
ends at the length limit). SmolLM2 parity lives in test_real_model.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tokenrelay.engine.beam_search import BeamSearchParams

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPTS = ["the quick brown fox", "hello world foo", "a b c d e f g"]


def widen_eos(src: Path, dst: Path, eos: list[int]) -> Path:
    """A copy of ``src`` whose config.json and generation_config.json name ``eos``."""
    shutil.copytree(src, dst)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((dst / name).read_text())
        cfg["eos_token_id"] = eos
        (dst / name).write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory):
    llama = tiny_checkpoint("llama")
    qwen2 = tiny_checkpoint("qwen2")
    base = tmp_path_factory.mktemp("eos")
    return {
        "llama": llama,
        "llama-eos": widen_eos(llama, base / "llama", [2, 37, 380]),
        "qwen2-eos": widen_eos(qwen2, base / "qwen2", [2, 989, 713]),
    }


def hf_beams(model, tok, prompt_ids: list[int], k: int, max_tokens: int,
             length_penalty: float = 1.0) -> list[tuple[list[int], float]]:
    """transformers' beams: (generated token ids, EOS included, score), best first."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=k, do_sample=False,
                         early_stopping=True, length_penalty=length_penalty,
                         num_return_sequences=k, max_new_tokens=max_tokens,
                         return_dict_in_generate=True, output_scores=True)
    eos_ids = model.generation_config.eos_token_id
    eos = {eos_ids} if isinstance(eos_ids, int) else set(eos_ids)
    beams = []
    for seq, score in zip(out.sequences, out.sequences_scores):
        gen = seq[len(prompt_ids):].tolist()
        # Shorter beams are padded after their EOS: cut after the first EOS.
        cut = next((i + 1 for i, t in enumerate(gen) if t in eos), len(gen))
        beams.append((gen[:cut], float(score)))
    return beams


def assert_same_beams(ours, theirs) -> None:
    assert [s.token_ids for s in ours.sequences] == [t for t, _ in theirs]
    for s, (_, score) in zip(ours.sequences, theirs):
        assert s.score == pytest.approx(score, abs=1e-4)
        assert s.cum_logprob == pytest.approx(sum(s.logprobs), abs=1e-4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["llama", "llama-eos", "qwen2-eos"])
@pytest.mark.parametrize("k", [2, 4])
def test_beams_match_transformers(checkpoints, name, k):
    from transformers import AutoModelForCausalLM

    from tokenrelay.engine import LLM

    path = checkpoints[name]
    llm = LLM(str(path), num_kv_blocks=256, block_size=4, max_model_len=256)
    tok = llm.get_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    chat = llm.engine.render_chat([{"role": "user", "content": "say something"}])
    prompts = [list(tok.encode(p)) for p in PROMPTS]
    prompts.append(list(tok.encode(chat, add_special_tokens=False)))
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=k, max_tokens=12))
    ended_on_eos = 0
    for ids, ours in zip(prompts, outs):
        assert len(ours.sequences) == k
        assert_same_beams(ours, hf_beams(model, tok, ids, k, 12))
        ended_on_eos += sum(s.finish_reason == "stop" for s in ours.sequences)
    if name.endswith("eos"):
        assert ended_on_eos > 0, "the widened EOS set should end some beams"
    assert llm.stats()["kv_blocks_used"] == 0
    assert all(rc == 0 for rc in llm.engine.block_manager.ref_counts)


@pytest.mark.timeout(300)
def test_length_penalty_and_min_tokens_match_transformers(checkpoints):
    from transformers import AutoModelForCausalLM

    from tokenrelay.engine import LLM

    path = checkpoints["llama-eos"]
    llm = LLM(str(path), num_kv_blocks=256, block_size=4, max_model_len=256)
    tok = llm.get_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = list(tok.encode(PROMPTS[0]))
    ours = llm.beam_search({"prompt_token_ids": ids},
                           BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.5))
    assert_same_beams(ours[0], hf_beams(model, tok, ids, 3, 10, length_penalty=0.5))
    ours = llm.beam_search({"prompt_token_ids": ids},
                           BeamSearchParams(beam_width=3, max_tokens=10, min_tokens=6))
    out = model.generate(torch.tensor([ids]), num_beams=3, do_sample=False, early_stopping=True,
                         num_return_sequences=3, max_new_tokens=10, min_new_tokens=6,
                         return_dict_in_generate=True, output_scores=True)
    for s, seq, score in zip(ours[0].sequences, out.sequences, out.sequences_scores):
        assert len(s.token_ids) >= 6
        assert s.token_ids == seq[len(ids):len(ids) + len(s.token_ids)].tolist()
        assert s.score == pytest.approx(float(score), abs=1e-4)


@pytest.mark.timeout(300)
def test_beams_are_the_same_under_preemption_chunking_and_company(checkpoints):
    """A pool so small that beams are preempted and recomputed, a token budget that chunks
    the prompt, and other requests in the batch: the beams do not change."""
    from tokenrelay.engine import LLM, SamplingParams

    path = str(checkpoints["llama-eos"])
    prompt = {"prompt_token_ids": list(range(40, 70))}
    params = BeamSearchParams(beam_width=3, max_tokens=10)
    alone = LLM(path, num_kv_blocks=256, block_size=4).beam_search(prompt, params)[0]

    tight = LLM(path, num_kv_blocks=24, block_size=4, max_num_batched_tokens=16, max_num_seqs=6)
    engine = tight.engine
    engine.add_request("other", list(range(100, 140)),
                       SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.0),
                       priority=-1)
    busy = tight.beam_search(prompt, params)[0]
    while engine.has_unfinished_requests():
        engine.step()
    assert [s.token_ids for s in busy.sequences] == [s.token_ids for s in alone.sequences]
    assert [s.score for s in busy.sequences] == pytest.approx(
        [s.score for s in alone.sequences], abs=1e-5)
    assert tight.stats()["num_preemptions"] > 0
    assert tight.stats()["kv_blocks_used"] == 0


@pytest.mark.timeout(120)
def test_beam_blocks_are_shared_and_all_come_back(checkpoints):
    """While the search runs, the blocks in use are exactly the union of the beams' block
    tables (a beam that dies frees what only it held), fewer than the beams would hold apart;
    afterwards every reference count is zero."""
    from tokenrelay.engine import SamplingParams
    from tokenrelay.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_kwargs(model=str(checkpoints["llama"]), num_kv_blocks=128,
                                   block_size=4)
    bm = engine.block_manager
    prompt = list(range(40, 61))        # 21 tokens: 5 full blocks and a partial one
    engine.add_request("b", prompt, SamplingParams(beam_width=4, max_tokens=16,
                                                   temperature=0.0))
    group = engine.requests["b"]
    saw_sharing = False
    while engine.has_unfinished_requests():
        engine.step()
        if "b" not in engine.requests:
            break
        tables = [s.block_table for s in group.seqs]
        union = {b for t in tables for b in t}
        assert bm.num_used_blocks == len(union)
        if group.forked:
            assert len(group.seqs) == 4
            assert all(t[:5] == tables[0][:5] for t in tables)   # the prompt's blocks, once
            saw_sharing |= len(union) < sum(len(t) for t in tables)
    assert saw_sharing
    assert bm.num_used_blocks == 0 and all(rc == 0 for rc in bm.ref_counts)


def test_beam_search_refuses_what_it_cannot_honour(checkpoints):
    from tokenrelay.engine import InvalidRequestError, PromptTooLongError, SamplingParams
    from tokenrelay.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_kwargs(model=str(checkpoints["llama"]), num_kv_blocks=16,
                                   block_size=4, max_beam_width=4, max_num_seqs=8)
    with pytest.raises(InvalidRequestError, match="beam_width: 5 exceeds"):
        engine.add_request("a", [5, 6, 7], SamplingParams(beam_width=5, max_tokens=4))
    with pytest.raises(PromptTooLongError, match="beam_width: 4 choices"):
        engine.add_request("b", [5] * 20, SamplingParams(beam_width=4, max_tokens=30))
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(beam_width=2, stop=["x"])
    with pytest.raises(InvalidRequestError, match="resume"):
        from tokenrelay.engine.outputs import ResumeState
        engine.add_request("c", [5, 6], SamplingParams(beam_width=2, max_tokens=4),
                           resume=ResumeState([7], "x"))
    assert not engine.requests


@pytest.mark.timeout(120)
def test_generate_with_beam_width_returns_every_beam_as_beam_search_does(checkpoints):
    """``LLM.generate(SamplingParams(beam_width=k))`` (vLLM's spelling through the sampling
    params) returns the k beams, best first, the same as ``LLM.beam_search``."""
    from tokenrelay.engine import LLM, SamplingParams

    llm = LLM(str(checkpoints["llama-eos"]), num_kv_blocks=256, block_size=4)
    prompt = {"prompt_token_ids": list(range(40, 60))}
    want = llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=8))[0].sequences
    got = llm.generate(prompt, SamplingParams(beam_width=3, max_tokens=8, temperature=0.0))[0]
    assert [o.index for o in got.outputs] == [0, 1, 2]
    assert [o.token_ids for o in got.outputs] == [s.token_ids for s in want]
    assert [o.text for o in got.outputs] == [s.text for s in want]
    assert [o.cumulative_logprob for o in got.outputs] == [s.cum_logprob for s in want]
    assert [o.finish_reason for o in got.outputs] == [s.finish_reason for s in want]
    assert got.finished and got.metrics.finished_time is not None
