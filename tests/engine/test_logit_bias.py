"""``logit_bias`` (OpenAI's, issue #40): the schema's bounds, the engine's vocabulary check, the
sampler adding it before penalties and temperature (logprobs stay the raw model's, as vLLM's
default), and a tiny model whose greedy answer it forces or bans, serial and overlapped."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from pydantic import ValidationError

from tokenrelay.engine.errors import InvalidRequestError
from tokenrelay.engine.llm import LLM
from tokenrelay.engine.sampler import Sampler
from tokenrelay.engine.sampling_params import SamplingParams
from tokenrelay.engine.sequence import Sequence

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.timeout(300)]

V = 50
_ids = itertools.count()


def seq(params: SamplingParams) -> Sequence:
    return Sequence(f"b{next(_ids)}", [1, 2, 3], params, priority=0, arrival_index=0, seed=1)


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


# -- the schema ----------------------------------------------------------------------------

def test_json_keys_are_token_ids_and_an_empty_map_is_no_bias():
    p = SamplingParams.model_validate({"logit_bias": {"7": 100, "12": -2.5}})
    assert p.logit_bias == {7: 100.0, 12: -2.5}
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams.model_validate(p.model_dump(mode="json")).logit_bias == p.logit_bias


@pytest.mark.parametrize("bias, says", [
    ({"7": 100.5}, "outside [-100, 100]"),
    ({"7": -101}, "outside [-100, 100]"),
    ({"7": float("inf")}, "outside [-100, 100]"),
    ({"7": "5"}, "must be a number"),
    ({"7": True}, "must be a number"),
    ({"seven": 1}, "is not a token id"),
    ({"-3": 1}, "is not a token id"),
    ({"1.5": 1}, "is not a token id"),
    ({"9" * 11: 1}, "is not a token id"),
    ({7: 1, "7": 2}, "names a token id twice"),
    ({str(i): 1 for i in range(301)}, "over OpenAI's limit of 300"),
    ([7, 100], "must be a map"),
])
def test_the_schema_refuses_what_openai_refuses(bias, says):
    with pytest.raises(ValidationError, match="logit_bias") as info:
        SamplingParams.model_validate({"logit_bias": bias})
    assert says in str(info.value)


def test_beam_search_refuses_it():
    with pytest.raises(ValidationError, match=r"beam search does not take \['logit_bias'\]"):
        SamplingParams(beam_width=2, logit_bias={3: 1.0})


# -- the sampler ---------------------------------------------------------------------------

def test_plus_100_forces_and_minus_100_bans_and_logprobs_stay_raw():
    sampler = Sampler(V, eos_token_ids=[0])
    lg = logits(4)
    argmax = lg.argmax(-1).tolist()
    weakest = lg.argmin(-1).tolist()
    params = [SamplingParams(temperature=0, logit_bias={weakest[0]: 100}, logprobs=1),
              SamplingParams(temperature=0, logit_bias={argmax[1]: -100}),
              SamplingParams(temperature=0),                                # no bias: untouched
              SamplingParams(temperature=1.0, top_p=0.5, seed=3, logit_bias={weakest[3]: 100})]
    out = sampler(lg, [seq(p) for p in params])
    second = lg[1].topk(2).indices[1].item()
    assert out.token_ids == [weakest[0], second, argmax[2], weakest[3]]
    raw = torch.log_softmax(lg, -1)
    assert math.isclose(out.logprobs[0], raw[0, weakest[0]].item(), abs_tol=1e-5)
    assert out.top_logprobs[0][argmax[0]] == pytest.approx(raw[0, argmax[0]].item(), abs=1e-5)
    assert torch.equal(lg, logits(4)), "the raw logits are never changed in place"


def test_bias_comes_before_penalties():
    """A repetition penalty divides a positive logit: applied after the bias it sees the
    biased value (vLLM's order), so a +100 token repeated is still far ahead."""
    sampler = Sampler(V, eos_token_ids=[])
    lg = torch.zeros(1, V)
    s = seq(SamplingParams(temperature=0, repetition_penalty=2.0, logit_bias={9: 100}))
    s.token_ids.append(9)
    assert sampler(lg, [s]).token_ids == [9]


# -- a tiny model, through LLM.generate ----------------------------------------------------

@pytest.fixture(scope="module")
def model_path(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("llama"))


PROMPTS = ["Once upon a time", "The queue said"]


@pytest.mark.parametrize("overlapped", [False, True], ids=["serial", "overlapped"])
def test_greedy_takes_the_favoured_token_every_time_and_never_the_banned_one(model_path,
                                                                            overlapped):
    llm = LLM(model_path, num_kv_blocks=256, async_scheduling=overlapped)
    try:
        plain = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        favoured = 123
        forced = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                      logit_bias={str(favoured): 100}))
        banned = [o.outputs[0].token_ids[0] for o in plain]
        bans = [llm.generate(p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                               logit_bias={b: -100}))[0]
                for p, b in zip(PROMPTS, banned)]
        overlapped_steps = llm.engine.overlap.phases.steps if overlapped else 0
    finally:
        llm.shutdown()
    assert (overlapped_steps >= 8 * 3) is overlapped     # the biased steps ran overlapped
    for o in forced:
        assert o.outputs[0].token_ids == [favoured] * 8
    for o, b in zip(bans, banned):
        assert b not in o.outputs[0].token_ids and len(o.outputs[0].token_ids) == 8


def test_a_biased_request_still_overlaps():
    """The bias needs no host tokens, so it leaves a sequence to the overlapped core."""
    assert seq(SamplingParams(logit_bias={1: 5})).overlappable
    assert not seq(SamplingParams(presence_penalty=1.0)).overlappable


def test_an_id_past_the_vocabulary_is_the_requests_error(model_path):
    llm = LLM(model_path, num_kv_blocks=64)
    try:
        vocab = llm.engine.vocab_size
        with pytest.raises(InvalidRequestError,
                           match=rf"logit_bias: token id {vocab} is outside the vocabulary "
                                 rf"\[0, {vocab}\)"):
            llm.engine.add_request("past", "hello", SamplingParams(logit_bias={vocab: 1.0}))
        assert "past" not in llm.engine.requests
        out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=2,
                                                   logit_bias={vocab - 1: 100}))
    finally:
        llm.shutdown()
    assert out[0].outputs[0].token_ids == [vocab - 1, vocab - 1]
