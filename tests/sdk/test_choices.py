"""n > 1 choices and beam search through the SDK (sync, async, CLI, batch runner) against an
in-process worker on the FakeEngine, whose outputs are known offline (``fake_completion`` per
choice, ``fake_beams``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tokenrelay.producer_sdk import AsyncClient, Client
from tokenrelay.producer_sdk.batch.runner import BatchRunner
from tests.sdk.test_cli import cli
from tokenrelay.worker.fake_engine import FakeEngine, fake_beam_logprob, fake_beams, fake_completion

pytestmark = pytest.mark.timeout(120)

SEED = 5


def expected(prompt: str, n: int, max_tokens: int) -> list[str]:
    return [fake_completion(prompt, max_tokens, seed=SEED, greedy=False, choice=i)
            for i in range(n)]


def test_n3_streams_three_choices_equal_to_the_offline_output(redis_server, start_worker):
    start_worker(engine=FakeEngine(step_delay=0.005))
    with Client(redis_server.url) as client:
        job = client.submit("three ways", n=3, max_tokens=6, temperature=1.0, seed=SEED)
        deltas = list(job.stream(timeout=30))
        result = job.result(timeout=30)
    want = expected("three ways", 3, 6)
    assert len(set(want)) == 3, "the fake choices must differ for this test to mean anything"
    by_choice: dict[int, str] = {}
    for d in deltas:
        assert d.position == len(by_choice.get(d.index, "")), d   # one char per token
        by_choice[d.index] = by_choice.get(d.index, "") + d.text
    assert [by_choice[i] for i in range(3)] == want
    assert [d.seq for d in deltas] == list(range(len(deltas)))
    last = {d.index: d for d in deltas}
    assert all(last[i].finish_reason == "length" for i in range(3))
    assert sum(1 for d in deltas if d.finish_reason) == 3          # each choice ends once
    assert [(o.index, o.text, o.finish_reason) for o in result.outputs] == \
        [(i, want[i], "length") for i in range(3)]
    assert result.text == want[0] and result.token_ids == [ord(c) for c in want[0]]
    assert result.usage.completion_tokens == 18
    assert all(o.cumulative_logprob == -3.0 for o in result.outputs)


def test_n2_without_streaming_has_every_choice_in_the_result(redis_server, start_worker):
    start_worker()
    with Client(redis_server.url) as client:
        result = client.submit("quiet", n=2, max_tokens=4, temperature=1.0, seed=SEED,
                               stream=False).result(timeout=30)
    assert [o.text for o in result.outputs] == expected("quiet", 2, 4)
    assert result.usage.completion_tokens == 8


def test_beam_search_delivers_its_beams_at_the_end_best_first(redis_server, start_worker):
    start_worker(engine=FakeEngine(step_delay=0.005))
    with Client(redis_server.url) as client:
        job = client.submit("beams", beam_width=3, max_tokens=5, length_penalty=0.5)
        deltas = list(job.stream(timeout=30))
        result = job.result(timeout=30)
    want = fake_beams("beams", 5, 3)
    assert [(d.index, d.position, d.text, d.finish_reason) for d in deltas] == \
        [(i, 0, want[i], "length") for i in range(3)]
    assert [o.text for o in result.outputs] == want and result.text == want[0]
    assert [o.cumulative_logprob for o in result.outputs] == \
        [fake_beam_logprob(5, r) for r in range(3)]
    assert result.usage.completion_tokens == 15


def test_async_client_streams_choices_and_outputs(redis_server, start_worker):
    start_worker(engine=FakeEngine(step_delay=0.005))

    async def main():
        async with AsyncClient(redis_server.url) as client:
            job = await client.submit("async ways", n=2, max_tokens=5, temperature=1.0,
                                      seed=SEED)
            deltas = [d async for d in job.stream(timeout=30)]
            return deltas, await job.result(timeout=30)
    deltas, result = asyncio.run(asyncio.wait_for(main(), 60))
    want = expected("async ways", 2, 5)
    assert ["".join(d.text for d in deltas if d.index == i) for i in range(2)] == want
    assert [o.text for o in result.outputs] == want


def test_cli_submit_prefixes_each_line_with_its_choice(redis_server, start_worker):
    start_worker(engine=FakeEngine(step_delay=0.002))
    want = expected("cli ways", 2, 4)
    for extra in ([], ["--stream"]):
        res = cli("submit", "cli ways", "--redis-url", redis_server.url, "--n", "2",
                  "--max-tokens", "4", "--temperature", "1", "--seed", str(SEED), *extra)
        assert res.returncode == 0, res.stderr
        assert sorted(res.stdout.splitlines()) == [f"[0] {want[0]}", f"[1] {want[1]}"], extra
        assert "tokens=8" in res.stderr


def test_batch_runner_maps_n_to_openai_choices(redis_server, start_worker, tmp_path: Path):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion
    start_worker()
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    lines = [{"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "n": 3,
                       "max_tokens": 3, "seed": SEED}},
             {"custom_id": "comp", "method": "POST", "url": "/v1/completions",
              "body": {"model": "fake", "prompt": "batch ways", "n": 2, "max_tokens": 4,
                       "seed": SEED}}]
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with Client(redis_server.url) as client:
        summary = BatchRunner(client, inp, out, err, batch_id="n", progress=False).run()
    assert summary.succeeded == 2, err.read_text() if err.exists() else ""
    bodies = {o["custom_id"]: o["response"]["body"]
              for o in map(json.loads, out.read_text().splitlines())}
    chat = ChatCompletion.model_validate(bodies["chat"], strict=True)
    comp = Completion.model_validate(bodies["comp"], strict=True)
    prompt = FakeEngine().render_chat([{"role": "user", "content": "hi"}])
    assert [(c.index, c.message.content, c.finish_reason) for c in chat.choices] == \
        [(i, t, "length") for i, t in enumerate(expected(prompt, 3, 3))]
    assert [(c.index, c.text) for c in comp.choices] == \
        list(enumerate(expected("batch ways", 2, 4)))
    assert (chat.usage.completion_tokens, comp.usage.completion_tokens) == (9, 8)


def test_a_job_cancelled_before_it_starts_ends_every_choice(redis_server, start_worker):
    with Client(redis_server.url) as client:
        job = client.submit("never", n=2, max_tokens=4, seed=SEED)
        job.cancel()
        start_worker()
        result = job.result(timeout=30)
    assert result.finish_reason == "cancelled"
    assert [(o.index, o.finish_reason, o.text) for o in result.outputs] == \
        [(0, "cancelled", ""), (1, "cancelled", "")]
