"""Jobs with several choices (n > 1) and beam search through real ``tokenrelay worker --model
fake:`` processes that are SIGKILLed: each choice of each stream must still hold each token
exactly once, equal to what the FakeEngine makes offline, and a choice that had finished before
the kill must not run again."""

from __future__ import annotations

import time

import pytest

from tests.fault_harness import wait_for
from tokenrelay.worker.fake_engine import fake_beams, fake_token

STOP = ord("q")


def offline(prompt: str, seed: int, n: int, max_tokens: int) -> list[tuple[str, str]]:
    """(text, finish_reason) of each choice as FakeEngine makes it, stopping at STOP."""
    ids = [ord(c) for c in prompt]
    out = []
    for choice in range(n):
        text, reason = "", "length"
        for pos in range(max_tokens):
            tok = fake_token(ids, seed, pos, False, choice)
            text += chr(tok)
            if tok == STOP:
                reason = "stop"
                break
        out.append((text, reason))
    return out


def seed_with_an_early_stop(prompt: str, n: int, max_tokens: int) -> int:
    """A seed under which one choice stops within 6 tokens and another runs to the end: the
    early one finishes before the kill, so the takeover must leave it alone."""
    for seed in range(10_000):
        outs = offline(prompt, seed, n, max_tokens)
        if any(len(t) <= 6 for t, _ in outs) and any(r == "length" for _, r in outs):
            return seed
    raise AssertionError("no such seed")


@pytest.mark.timeout(120)
def test_sigkill_mid_stream_leaves_every_choice_exact_and_unrepeated(env):
    w1 = env.worker("w1", delay=0.05)
    prompt, n, max_tokens = "choices survive a kill", 3, 40
    seed = seed_with_an_early_stop(prompt, n, max_tokens)
    want = offline(prompt, seed, n, max_tokens)
    jobs = env.submit([prompt] * 3, prefix="n3", n=n, max_tokens=max_tokens, temperature=1.0,
                      seed=seed, stop_token_ids=[STOP])
    wait_for(lambda: all(max((len(c.token_ids) for c in r.choices.values()), default=0) >= 12
                         for r in env.streams(jobs).values()), 30, what="every job streaming")
    before = env.streams(jobs)
    w1.kill()                                             # SIGKILL, mid-generation
    env.worker("w2", delay=0.01)
    reports = env.wait_ended(jobs, timeout=60)
    env.assert_exactly_once(reports)                      # per choice: positions, no repeats
    for job_id in jobs:
        rep = reports[job_id]
        assert rep.kind == f"done:{want[0][1]}", rep.kind
        assert [(rep.choices[i].text, rep.choices[i].finish_reason) for i in range(n)] == want
        assert [(c.index, c.finish_reason) for c in rep.terminal.choices] == \
            [(i, r) for i, (_, r) in enumerate(want)]
        assert rep.terminal.usage.completion_tokens == sum(len(t) for t, _ in want)
        assert len(rep.started) == 2 and rep.started[-1].worker_id == "w2"
        assert rep.started[-1].resumed_tokens > 0
        early = [i for i, c in before[job_id].choices.items() if c.finish_reason]
        assert early, "no choice had finished before the kill: the test proved nothing"
        for i in early:                                   # finished before: not run again
            assert rep.choices[i].num_token_events == before[job_id].choices[i].num_token_events


@pytest.mark.timeout(120)
def test_beam_job_killed_before_the_end_is_rerun_and_holds_each_beam_once(env):
    w1 = env.worker("w1", delay=0.05)
    prompt, width, max_tokens = "beams survive a kill", 3, 60
    (job,) = env.submit([prompt], prefix="beam", beam_width=width, max_tokens=max_tokens)
    wait_for(lambda: env.streams([job])[job].started, 20, what="the beam job started")
    time.sleep(0.5)
    assert env.streams([job])[job].num_token_events == 0, "beam search streamed early"
    w1.kill()
    env.worker("w2", delay=0.01)
    rep = env.wait_ended([job], timeout=60)[job]
    env.assert_exactly_once({job: rep})
    assert rep.kind == "done:length"
    assert [rep.choices[i].text for i in range(width)] == fake_beams(prompt, max_tokens, width)
    assert all(rep.choices[i].num_token_events == 1 for i in range(width))
    assert rep.num_token_events == width
    assert [s.worker_id for s in rep.started] == ["w1", "w2"]
    assert rep.started[-1].resumed_tokens == 0            # rerun, not resumed
    assert [c.index for c in rep.terminal.choices] == list(range(width))
