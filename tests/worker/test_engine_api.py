"""The engine contract the worker drives (worker/engine_api.py), run against every engine it
serves: the real LLMEngine on a tiny checkpoint, the same engine with its core in a process of
its own (EngineCoreClient, ``--engine-process on``) and the FakeEngine behind ``--model fake:``.

Each check is a promise the worker relies on: refusals are the documented exceptions and leave
nothing behind, a step returns at most one delta per request with consistent counts, a resumed
request continues where it stopped, abort frees capacity at once."""

from __future__ import annotations

from typing import Any, Optional

import pytest

from tokenrelay.engine.errors import InvalidRequestError, PromptTooLongError
from tokenrelay.engine.outputs import RequestDelta, ResumeState
from tokenrelay.engine.sampling_params import SamplingParams
from tokenrelay.worker.engine_api import EngineAPI
from tokenrelay.worker.fake_engine import FakeEngine

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("single_thread")]


@pytest.fixture(scope="module", params=["fake", "llm", "core_process"])
def engine(request, tiny_checkpoint) -> Any:
    if request.param == "fake":
        yield FakeEngine(max_num_seqs=4, max_model_len=256)
        return
    from tokenrelay.engine.config import EngineConfig
    config = EngineConfig(model=str(tiny_checkpoint("llama")), device="cpu", dtype="float32",
                          max_num_seqs=4, max_model_len=256, num_kv_blocks=64,
                          enforce_eager=True)
    if request.param == "llm":
        from tokenrelay.engine.llm_engine import LLMEngine
        yield LLMEngine(config)
        return
    from tokenrelay.engine.core_client import EngineCoreClient
    client = EngineCoreClient(config, threads=1)
    yield client
    client.shutdown()


@pytest.fixture
def eng(engine):
    yield engine
    while engine.has_unfinished_requests():  # leave it empty for the next test
        engine.step()


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def run(eng, ids: set[str]) -> dict[str, list[RequestDelta]]:
    out: dict[str, list[RequestDelta]] = {i: [] for i in ids}
    while any(not d or not d[-1].finished for d in out.values()):
        deltas = list(eng.step())
        assert len({d.request_id for d in deltas}) == len(deltas), "two deltas for one request"
        for d in deltas:
            if d.request_id in out:
                out[d.request_id].append(d)
    return out


def test_satisfies_the_protocol(eng):
    assert isinstance(eng, EngineAPI)
    ids = eng.tokenizer.encode("hello", add_special_tokens=False)
    assert ids and all(isinstance(t, int) for t in ids)
    assert isinstance(eng.render_chat([{"role": "user", "content": "hi"}]), str)
    assert {"num_running", "num_waiting"} <= set(eng.stats())


def test_refusals_are_the_documented_errors_and_change_nothing(eng):
    free = eng.free_capacity()
    with pytest.raises(PromptTooLongError):
        eng.add_request("long", "hello " * 400, greedy(8))
    eng.add_request("dup", "hello", greedy(2))
    with pytest.raises(InvalidRequestError):
        eng.add_request("dup", "hello", greedy(2))
    assert eng.free_capacity() == free - 1
    assert eng.abort_request("dup") and not eng.abort_request("dup")
    assert eng.free_capacity() == free and not eng.has_unfinished_requests()


def test_a_step_streams_each_request_once_with_consistent_counts(eng):
    eng.add_request("a", "the quick brown fox", greedy(5))
    eng.add_request("b", [5, 6, 7, 8], greedy(3), priority=-1)
    got = run(eng, {"a", "b"})
    for rid, n in (("a", 5), ("b", 3)):
        deltas = got[rid]
        assert sum(len(d.new_token_ids) for d in deltas) == n
        last = deltas[-1]
        assert last.finished and last.finish_reason == "length" and last.num_output_tokens == n
        assert last.num_prompt_tokens > 0
        assert not any(d.finished for d in deltas[:-1])


def test_resume_continues_exactly(eng):
    eng.add_request("full", "resume me please", greedy(6))
    full = [t for d in run(eng, {"full"})["full"] for t in d.new_token_ids]
    eng.add_request("cut", "resume me please", greedy(6))
    # The first two tokens delivered (a core in its own process may have run further ahead).
    first = [t for d in run_steps(eng, "cut", 2) for t in d.new_token_ids][:2]
    eng.abort_request("cut")
    eng.add_request("rest", "resume me please", greedy(6),
                    resume=ResumeState(output_token_ids=first, output_text=""))
    rest = [t for d in run(eng, {"rest"})["rest"] for t in d.new_token_ids]
    assert first + rest == full


def run_steps(eng, rid: str, n: int) -> list[RequestDelta]:
    out: list[RequestDelta] = []
    while sum(len(d.new_token_ids) for d in out) < n:
        out += [d for d in eng.step() if d.request_id == rid]
    return out


# ------------------------------------------------------------------------------------------
# choices (n > 1) and beam search
# ------------------------------------------------------------------------------------------

def sampled(n: int, max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=11, ignore_eos=True,
                          **kw)


def run_choices(eng, rid: str, steps: Optional[int] = None) -> dict[int, list[RequestDelta]]:
    """Step until every choice of ``rid`` finished (or ``steps`` steps): its deltas by index,
    checking that a step never returns two deltas for one (request, index)."""
    out: dict[int, list[RequestDelta]] = {}
    taken = 0
    while eng.has_unfinished_requests() and (steps is None or taken < steps):
        deltas = list(eng.step())
        taken += 1
        keys = [(d.request_id, d.index) for d in deltas]
        assert len(set(keys)) == len(keys), f"two deltas for one choice in one step: {keys}"
        for d in deltas:
            if d.request_id == rid:
                out.setdefault(d.index, []).append(d)
    return out


def tokens(deltas: list[RequestDelta]) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


def test_n_choices_stream_per_choice_and_each_ends_once(eng):
    eng.add_request("n3", "three choices of one prompt", sampled(3, 5))
    got = run_choices(eng, "n3")
    assert sorted(got) == [0, 1, 2]
    for index, deltas in got.items():
        assert len(tokens(deltas)) == 5, index
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True], index
        last = deltas[-1]
        assert last.finish_reason == "length" and last.num_output_tokens == 5
    assert not eng.has_unfinished_requests()
    assert len({tuple(tokens(d)) for d in got.values()}) > 1, "sampled choices all identical"


def test_n_choices_resume_per_choice(eng):
    params = sampled(3, 6)
    eng.add_request("whole", "resume each choice", params)
    full = {i: tokens(d) for i, d in run_choices(eng, "whole").items()}
    eng.add_request("cut", "resume each choice", sampled(3, 6))
    # At most two tokens of each choice (a core in its own process may have run further).
    part = {i: tokens(d)[:2] for i, d in run_choices(eng, "cut", steps=2).items()}
    eng.abort_request("cut")
    assert part and all(len(part.get(i, [])) < 6 for i in range(3))
    resume = [ResumeState(part.get(0, []), ""),
              ResumeState(full[1], "", finish_reason="length"),   # already finished: not rerun
              ResumeState([], "")]                                 # nothing delivered of it
    eng.add_request("rest", "resume each choice", sampled(3, 6), resume=resume)
    rest = run_choices(eng, "rest")
    assert 1 not in rest, "a finished choice was run again"
    assert part.get(0, []) + tokens(rest[0]) == full[0]
    assert tokens(rest[2]) == full[2]
    assert rest[0][-1].finished and rest[2][-1].finished
    assert not eng.has_unfinished_requests()


def test_beam_search_returns_every_beam_in_one_final_step(eng):
    params = SamplingParams(beam_width=2, max_tokens=4, ignore_eos=True)
    eng.add_request("beam", "search two beams", params)
    steps: list[list[RequestDelta]] = []
    while eng.has_unfinished_requests():
        steps.append([d for d in eng.step() if d.request_id == "beam"])
    with_output = [s for s in steps if s]
    assert len(with_output) == 1 and steps[-1], "beams must arrive together, in the last step"
    beams = with_output[0]
    assert [d.index for d in beams] == [0, 1]
    assert all(d.finished and d.new_token_ids and len(d.new_token_ids) == d.num_output_tokens
               for d in beams)
    scores = [d.cumulative_logprob for d in beams]
    if None not in scores:
        assert scores[0] >= scores[1], "beams must come best first"
    eng.add_request("again", "search two beams", params)       # deterministic: a rerun is exact
    again = [d for _ in iter(eng.has_unfinished_requests, False) for d in eng.step()
             if d.request_id == "again"]
    assert [d.new_token_ids for d in again] == [d.new_token_ids for d in beams]


@pytest.mark.parametrize("choice, device, on", [
    ("auto", "cuda", True), ("auto", "cuda:1", True), ("auto", "cpu", False),
    ("on", "cpu", True), ("off", "cuda", False),
])
def test_engine_process_resolves_as_the_worker_and_its_benchmark_need(choice, device, on):
    from tokenrelay.worker.engine_api import core_process_on
    assert core_process_on(choice, device) is on


def test_an_unknown_engine_process_choice_says_what_is_expected():
    from tokenrelay.worker.engine_api import core_process_on
    with pytest.raises(ValueError, match="expected auto, on or off"):
        core_process_on("yes", "cuda")
