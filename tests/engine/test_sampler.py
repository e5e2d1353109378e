"""Sampler: greedy, truncation knobs, penalties, min_tokens, logprobs, seed reproducibility."""

from __future__ import annotations

import itertools
import math

import torch

from tokenrelay.engine.sampler import Sampler, mix_seed
from tokenrelay.engine.sampling_params import SamplingParams
from tokenrelay.engine.sequence import Sequence

V = 50
_ids = itertools.count()


def seq(params: SamplingParams, outputs: list[int] = (), seed: int = 1,
        prompt: list[int] = (1, 2, 3)) -> Sequence:
    s = Sequence(f"r{next(_ids)}", list(prompt), params, priority=0, arrival_index=0, seed=seed)
    s.token_ids.extend(outputs)
    return s


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_logprob_is_log_softmax():
    sampler = Sampler(V, eos_token_ids=[0])
    lg = logits(4)
    out = sampler(lg, [seq(SamplingParams(temperature=0, logprobs=0)) for _ in range(4)])
    assert out.token_ids == lg.argmax(-1).tolist()
    ref = torch.log_softmax(lg, -1).max(-1).values.tolist()
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(out.logprobs, ref))
    assert out.top_logprobs == [{t: lp} for t, lp in zip(out.token_ids, out.logprobs)]


def test_logprobs_only_for_the_rows_that_asked(monkeypatch):
    """Nobody asked: no log-sum-exp over the vocabulary at all. Some asked: theirs only, the
    same values as when every row asks."""
    sampler = Sampler(V, eos_token_ids=[0])
    lg = logits(4, seed=3)
    calls = []
    real = torch.logsumexp
    monkeypatch.setattr(torch, "logsumexp", lambda x, *a, **k: calls.append(x.shape) or
                        real(x, *a, **k))
    none = sampler(lg, [seq(SamplingParams(temperature=0)) for _ in range(4)])
    assert none.logprobs == [None] * 4 and none.top_logprobs == [None] * 4 and calls == []
    mixed = sampler(lg, [seq(SamplingParams(temperature=0, logprobs=2 if i % 2 else None))
                         for i in range(4)])
    assert calls == [(2, V)]
    every = sampler(lg, [seq(SamplingParams(temperature=0, logprobs=2)) for _ in range(4)])
    assert mixed.token_ids == none.token_ids == every.token_ids
    assert mixed.logprobs[0] is None and mixed.logprobs[2] is None
    assert [mixed.logprobs[i] for i in (1, 3)] == [every.logprobs[i] for i in (1, 3)]
    assert [mixed.top_logprobs[i] for i in (1, 3)] == [every.top_logprobs[i] for i in (1, 3)]


def test_greedy_ties_go_to_the_lowest_token_id():
    """Same rule as argmax (and transformers): the first maximal id, in large and small rows."""
    sampler = Sampler(32000, eos_token_ids=[])
    lg = torch.zeros(3, 32000)
    lg[0, [7, 31999]] = 5.0
    lg[1, [20000, 20001, 3]] = 2.0
    out = sampler(lg, [seq(SamplingParams(temperature=0)) for _ in range(3)])
    assert out.token_ids == [7, 3, 0]


def test_top_k_1_and_tiny_top_p_equal_greedy():
    sampler = Sampler(V, eos_token_ids=[])
    lg = logits(6, seed=1)
    params = [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.7, top_p=1e-6)]
    out = sampler(lg[:2], [seq(p) for p in params])
    assert out.token_ids == lg[:2].argmax(-1).tolist()


def test_min_p_1_equals_greedy():
    sampler = Sampler(V, eos_token_ids=[])
    lg = logits(3, seed=2)
    out = sampler(lg, [seq(SamplingParams(temperature=2.0, min_p=1.0)) for _ in range(3)])
    assert out.token_ids == lg.argmax(-1).tolist()


def test_top_k_restricts_support():
    sampler = Sampler(V, eos_token_ids=[])
    lg = logits(1, seed=3)
    top5 = set(lg[0].topk(5).indices.tolist())
    for s in range(40):
        out = sampler(lg, [seq(SamplingParams(temperature=5.0, top_k=5), seed=s)])
        assert out.token_ids[0] in top5


def test_seeded_sample_depends_only_on_seed_and_position():
    sampler = Sampler(V, eos_token_ids=[])
    lg = logits(1, seed=4)
    p = SamplingParams(temperature=1.0, seed=123)
    alone = sampler(lg, [seq(p, seed=123)]).token_ids[0]
    others = logits(4, seed=5)
    batch = torch.cat([others[:2], lg, others[2:]])
    mixed = [seq(SamplingParams(temperature=1.0), seed=s) for s in (9, 10)]
    mixed += [seq(p, seed=123)]
    mixed += [seq(SamplingParams(temperature=0.0)), seq(SamplingParams(temperature=0.5), seed=3)]
    together = sampler(batch, mixed).token_ids[2]
    assert alone == together
    # A different output position draws different noise (so the stream is not constant).
    draws = {sampler(lg, [seq(SamplingParams(temperature=50.0), outputs=[5] * k, seed=123)])
             .token_ids[0] for k in range(20)}
    assert len(draws) > 1
    assert mix_seed(1, 0) != mix_seed(1, 1) != mix_seed(2, 0)


def test_sampling_follows_the_distribution():
    sampler = Sampler(4, eos_token_ids=[])
    lg = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    counts = [0] * 4
    for s in range(2000):
        counts[sampler(lg, [seq(SamplingParams(temperature=1.0), seed=s)]).token_ids[0]] += 1
    for c, p in zip(counts, [0.1, 0.2, 0.3, 0.4]):
        assert abs(c / 2000 - p) < 0.04


def test_min_tokens_masks_eos_and_stop_token_ids():
    sampler = Sampler(V, eos_token_ids=[0])
    lg = torch.zeros(1, V)
    lg[0, 0] = 10.0
    lg[0, 1] = 9.0
    lg[0, 2] = 8.0
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    assert sampler(lg, [seq(p)]).token_ids == [2]
    assert sampler(lg, [seq(p, outputs=[5, 5])]).token_ids == [0]   # min reached
    p_ign = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sampler(lg, [seq(p_ign)]).token_ids == [0]   # EOS is not a stop, so not masked


def test_penalties():
    sampler = Sampler(V, eos_token_ids=[])
    lg = torch.zeros(1, V)
    lg[0, 10] = 2.0
    lg[0, 11] = 1.9
    rep = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert sampler(lg, [seq(rep, prompt=[10])]).token_ids == [11]
    freq = SamplingParams(temperature=0, frequency_penalty=0.06)
    assert sampler(lg, [seq(freq, outputs=[10])]).token_ids == [10]
    assert sampler(lg, [seq(freq, outputs=[10, 10])]).token_ids == [11]
    pres = SamplingParams(temperature=0, presence_penalty=0.2)
    assert sampler(lg, [seq(pres, outputs=[10])]).token_ids == [11]
    # Penalties only touch their own row.
    out = sampler(torch.cat([lg, lg]), [seq(pres, outputs=[10]), seq(SamplingParams(temperature=0))])
    assert out.token_ids == [11, 10]


def test_logprobs_top_n_plus_chosen_from_raw_distribution():
    sampler = Sampler(V, eos_token_ids=[])
    lg = logits(2, seed=6)
    ref = torch.log_softmax(lg, -1)
    p = SamplingParams(temperature=1.0, top_k=3, logprobs=2, seed=5)
    out = sampler(lg, [seq(p, seed=5), seq(SamplingParams(temperature=0, logprobs=0))])
    d0 = out.top_logprobs[0]
    top2 = ref[0].topk(2).indices.tolist()
    assert set(top2) <= set(d0) and out.token_ids[0] in d0 and len(d0) <= 3
    for t, lp in d0.items():
        assert math.isclose(lp, ref[0, t].item(), abs_tol=1e-5)
    assert out.top_logprobs[1] == {out.token_ids[1]: out.logprobs[1]}
