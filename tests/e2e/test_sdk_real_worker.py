"""The producer SDK against the real worker and engine (tiny random-weight llama on CPU).

One engine per module (building it costs seconds) is shared by in-process Worker threads; each
test starts its own worker and stops it at teardown, also on failure. The batch runner is killed
as a subprocess, the worker keeps running across the kill.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import uvicorn

from tokenrelay.producer_sdk import AsyncClient, Client, QueueFull
from tokenrelay.producer_sdk.batch.runner import BatchRunner
from tokenrelay.protocol.keys import Keys
from tests.fault_harness import wait_for
from tests.sdk_helpers import RealWorker, free_port, sdk_redis, sdk_url  # noqa: F401
from tests.sdk.test_batch_runner import read_jsonl, run_cli_batch, write_input
from tests.e2e.test_example_fastapi import parse_sse

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tokenrelay.engine.llm_engine") is None
    or importlib.util.find_spec("tokenrelay.worker.service") is None,
    reason="the real engine/worker are not available")

KEYS = Keys()
ENGINE_KW = dict(kv_cache_memory_bytes=64 * 2**20, max_num_seqs=32, max_model_len=256)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    from tokenrelay.engine.llm import LLM
    return LLM(str(tiny_checkpoint("llama")), **ENGINE_KW)


@pytest.fixture
def worker(sdk_url: str, llm) -> Iterator[RealWorker]:
    w = RealWorker(sdk_url, llm.engine, served_model_name="tiny").start()  # the batch lines' model
    try:
        yield w
    finally:
        w.stop()


def test_sync_submit_stream_result_cancel_reattach(sdk_url: str, llm, worker: RealWorker):
    from tokenrelay.engine.sampling_params import SamplingParams
    with Client(sdk_url) as c:
        job = c.submit("Hello there, how are you", job_id="real-1", max_tokens=8, temperature=0)
        streamed = "".join(d.text for d in job.stream(timeout=60))
        res = job.result(timeout=5)
        assert streamed == res.text and len(res.token_ids) == 8
        assert res.finish_reason == "length" and res.usage.completion_tokens == 8
        # Idempotent resubmit and reattach by id: the same job, not a second one.
        again = c.submit("Hello there, how are you", job_id="real-1", max_tokens=8, temperature=0)
        assert again.reattached and c.get("real-1").result(timeout=10).text == res.text
        starts = [f for _, f in c.redis.xrange(KEYS.results("real-1")) if b"started" in f[b"data"]]
        assert len(starts) == 1
        # Cancel a long job after its first token.
        long = c.submit("Tell me a long story", max_tokens=200, temperature=0)
        next(iter(long.stream(timeout=60)))
        long.cancel()
        cancelled = long.result(timeout=60)
        assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) < 200
    worker.stop()  # the engine is free again: compare with offline generation
    expected = llm.generate("Hello there, how are you",
                            SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    assert res.text == expected


def test_choices_and_beams_through_the_queue_equal_the_offline_engine(sdk_url: str, llm,
                                                                       worker: RealWorker):
    """An n = 3 job streams three choices, each equal to the offline engine's; a beam search
    job delivers the offline beams, best first, when the search ends."""
    from tokenrelay.engine.beam_search import BeamSearchParams
    from tokenrelay.engine.sampling_params import SamplingParams
    prompt = "Several choices of one prompt"
    with Client(sdk_url) as c:
        job = c.submit(prompt, n=3, seed=4, temperature=1.0, max_tokens=10, ignore_eos=True)
        texts: dict[int, str] = {0: "", 1: "", 2: ""}
        for d in job.stream(timeout=60):
            texts[d.index] += d.text
        sampled = job.result(timeout=10)
        beam = c.submit(prompt, beam_width=3, max_tokens=8, temperature=0.0).result(timeout=60)
    worker.stop()  # the engine is free again: compare with offline generation
    offline = llm.generate(prompt, SamplingParams(n=3, seed=4, temperature=1.0, max_tokens=10,
                                                  ignore_eos=True))[0]
    assert [o.index for o in sampled.outputs] == [0, 1, 2]
    for got, want in zip(sampled.outputs, offline.outputs):
        assert got.token_ids == want.token_ids and got.text == want.text == texts[got.index]
    assert sampled.text == offline.outputs[0].text
    assert sampled.usage.completion_tokens == 30
    beams = llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=8))[0].sequences
    assert [o.token_ids for o in beam.outputs] == [b.token_ids for b in beams]
    assert [o.text for o in beam.outputs] == [b.text for b in beams]


def test_async_submit_stream_result_cancel(sdk_url: str, worker: RealWorker):
    async def main():
        async with AsyncClient(sdk_url) as c:
            job = await c.submit(messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                 temperature=0)
            text = "".join([d.text async for d in job.stream(timeout=60)])
            res = await job.result()
            assert text == res.text and res.usage.completion_tokens == 6
            long = await c.submit("Another long story", max_tokens=200, temperature=0)
            async for _ in long.stream(timeout=60):
                break
            await long.cancel()
            assert (await long.result(timeout=60)).finish_reason == "cancelled"
            got = await c.map([f"prompt {i}" for i in range(6)], concurrency=3, progress=False,
                              max_tokens=2, temperature=0)
            assert all(r.usage.completion_tokens == 2 for r in got)

    asyncio.run(asyncio.wait_for(main(), 120))


def test_queue_full_then_block_until_worker_drains(sdk_url: str, llm):
    with Client(sdk_url, max_queued_jobs=2) as c:
        queued = c.submit_many(["one", "two"], max_tokens=2)
        with pytest.raises(QueueFull):
            c.submit("three", max_tokens=2)
        w = RealWorker(sdk_url, llm.engine)
        timer = threading.Timer(0.3, w.start)
        timer.start()
        try:
            third = c.submit("three", max_tokens=2, block=True, block_timeout=60)
            for j in [*queued, third]:
                assert j.result(timeout=60).usage.completion_tokens == 2
        finally:
            timer.join()
            w.stop()


def test_batch_200_with_malformed_lines(sdk_url: str, worker: RealWorker, tmp_path: Path):
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    write_input(inp, 200, {3: "{", 77: json.dumps({"custom_id": "req-77"}), 140: "[1, 2]"})
    with Client(sdk_url) as c:
        summary = BatchRunner(c, inp, out, err, batch_id="real200", concurrency=64,
                              progress=False).run()
    assert (summary.succeeded, summary.malformed, summary.failed) == (197, 3, 0)
    outputs = read_jsonl(out)
    assert len({o["custom_id"] for o in outputs}) == 197
    assert all(o["response"]["body"]["usage"]["completion_tokens"] >= 1 for o in outputs)
    assert sorted(e["error"]["line"] for e in read_jsonl(err)) == [4, 78, 141]


def test_batch_killed_and_rerun_exactly_once(sdk_url: str, worker: RealWorker, tmp_path: Path):
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    # Longer jobs than the other batch test, so the kill lands while most are unanswered.
    write_input(inp, 200, {20: "nope", 90: "{}", 150: "[]"}, max_tokens=24)
    proc = run_cli_batch(sdk_url, inp, out, err)
    try:
        deadline = time.monotonic() + 90
        while len(read_jsonl(out)) < 40:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert len(read_jsonl(out)) < 197
        proc = run_cli_batch(sdk_url, inp, out, err)
        _, stderr = proc.communicate(timeout=150)
        # three malformed lines: the batch exits 1 (the errors file holds lines; issue #40)
        assert proc.returncode == 1, stderr.decode()[-2000:]
        assert "3 line(s)" in stderr.decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    named = [o["custom_id"] for o in read_jsonl(out)] + [
        e["custom_id"] for e in read_jsonl(err) if e["custom_id"] is not None]
    assert len(named) == len(set(named)) == 197
    assert {f"req-{i}" for i in range(200)} - set(named) == {"req-20", "req-90", "req-150"}


def test_fastapi_example_streams_and_cancels(sdk_url: str, worker: RealWorker):
    from examples.fastapi_app import create_app
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(sdk_url), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: server.started, timeout=20)
        with httpx.stream("POST", f"{base}/v1/generate", timeout=60,
                          json={"prompt": "Hi", "max_tokens": 5, "temperature": 0}) as resp:
            events = list(parse_sse(resp.iter_lines()))
        assert events[-1][0] == "done" and events[-1][1]["usage"]["completion_tokens"] == 5
        assert "".join(d["text"] for e, d in events if e == "message") == events[-1][1]["text"]
        # Greedy, so the job cannot sample an end-of-sequence token before the cancel (a random
        # draw did, once in CI: finish_reason "stop" after one token).
        with httpx.stream("POST", f"{base}/v1/generate", timeout=60,
                          json={"prompt": "Go on and on", "max_tokens": 200,
                                "temperature": 0}) as resp:
            it = parse_sse(resp.iter_lines())
            job_id = next(it)[1]["job_id"]
            next(it)
        with Client(sdk_url) as c:
            res = c.get(job_id).result(timeout=60)
        assert res.finish_reason == "cancelled" and len(res.token_ids) < 200
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.mark.parametrize("stream", [True, False])
def test_logprobs_name_each_token_as_the_real_tokenizer_decodes_it(sdk_url: str, llm,
                                                                   worker: RealWorker,
                                                                   stream: bool):
    """Every reported token (chosen and top) carries the tokenizer's decode of its single id,
    and bytes that decode to it; the logprobs are the engine's own, alternatives best first."""
    tok = llm.engine.tokenizer
    with Client(sdk_url) as client:
        job = client.submit(prompt="Once upon a time", max_tokens=8, temperature=0,
                            logprobs=3, stream=stream, ignore_eos=True)
        deltas = list(job.stream(timeout=60))
        res = job.result(timeout=60)
    assert res.token_logprobs is not None and len(res.token_logprobs) == 8
    assert [t.token_id for t in res.token_logprobs] == res.token_ids
    named = [t for d in deltas for t in (d.token_logprobs or [])]
    assert named == res.token_logprobs
    for t, raw in zip(res.token_logprobs, res.logprobs):
        assert t.logprob == raw[t.token_id]
        assert [a.token_id for a in t.top_logprobs] == sorted(raw, key=lambda k: -raw[k])
        assert len(t.top_logprobs) in (3, 4)         # top 3, plus the chosen when not among them
        for entry in (t, *t.top_logprobs):
            assert entry.token == tok.decode([entry.token_id], skip_special_tokens=False)
            assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
