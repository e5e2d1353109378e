"""Structured outputs through Redis and real ``tokenrelay worker`` processes on the tiny
checkpoint (our engine, CPU): a worker SIGKILLed in the middle of JSON answers, whose jobs the
other worker resumes, gives each job exactly the answer of an uninterrupted seeded run, and it
parses; hostile constraints (huge, deeply nested, a pathological regex, sent by a raw producer
past the SDK's checks) each end their own job with ``invalid_request`` within the compile
timeout while another job keeps streaming, and the worker lives on."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from tests.fault_harness import submit, wait_for

# An answer that runs long (about 60 tokens): time to kill a worker in the middle of it.
LONG = {"type": "object", "additionalProperties": False, "required": ["items"],
        "properties": {"items": {"type": "array", "minItems": 8, "maxItems": 8,
                                 "items": {"type": "string", "maxLength": 5}}}}
REAL = {"max-num-seqs": 32, "dtype": "float32"}
EAGER = {"TOKENRELAY_ENFORCE_EAGER": "true"}     # seconds less start-up (no compiled kernels)


@pytest.mark.timeout(300)
def test_sigkill_in_the_middle_of_json_answers_resumes_them_exactly(env, tiny_checkpoint):
    model = str(tiny_checkpoint("llama"))
    workers = {wid: env.worker(wid, model=model, wait=False, env=EAGER, **REAL) for wid in ("w1", "w2")}
    for w in workers.values():
        w.wait_for_log("worker ready", timeout=180)
    prompts = [f"List {i} things:" for i in range(12)]
    jobs = []
    for i, p in enumerate(prompts):            # one seed per job: each answer is its own
        jobs += env.submit([p], prefix=f"json{i}", temperature=1.0, seed=100 + i,
                           max_tokens=120, structured_outputs={"json": LONG})
    wait_for(lambda: env.tokens_streamed(jobs) >= 12 * 6, 60, what="JSON answers streaming")
    victim = max(workers, key=lambda wid: len(env.held_by(wid)))
    held = env.held_by(victim)
    workers[victim].kill()                     # SIGKILL, mid-answer
    reports = env.wait_ended(jobs, timeout=120)
    env.assert_exactly_once(reports)
    from tokenrelay.engine.llm import LLM
    from tokenrelay.engine.sampling_params import SamplingParams
    llm = LLM(model, device="cpu", dtype="float32", enforce_eager=True)
    offline = llm.generate(prompts, [SamplingParams.model_validate(
        {"temperature": 1.0, "seed": 100 + i, "max_tokens": 120,
         "structured_outputs": {"json": LONG}}) for i in range(len(prompts))])
    for job_id, out in zip(jobs, offline):
        rep, want = reports[job_id], out.outputs[0]
        assert rep.token_ids == want.token_ids and rep.text == want.text, job_id
        assert rep.kind == f"done:{want.finish_reason}"
        if want.finish_reason == "stop":
            jsonschema.validate(json.loads(rep.text), LONG)
    resumed = [r for r in reports.values() if len(r.started) > 1]
    assert held and resumed, "the victim held nothing when killed: the test proved nothing"
    assert any(r.started[-1].resumed_tokens > 0 and r.kind == "done:stop" for r in resumed), \
        "no JSON answer was resumed from the middle and completed"


def hostile_jobs() -> dict[str, dict]:
    """Raw payloads a producer that skips the SDK could send, each worse in its own way."""
    deep: dict = {"type": "string"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    huge = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": "[a-z]+"}
                                             for i in range(4000)}}
    return {
        "huge": {"structured_outputs": {"json": huge}},
        "deep": {"structured_outputs": {"json": deep}},
        "regex": {"structured_outputs": {"regex": "a{1000}{1000}"}},
        "words": {"structured_outputs": {"regex": r"(\w+\s?){1,1000}"}},   # max_regex_expansion
        "choices": {"structured_outputs": {"choice": [f"option {i}" for i in range(20_000)]}},
    }


@pytest.mark.timeout(240)
def test_hostile_constraints_end_their_own_jobs_while_another_keeps_streaming(env,
                                                                              tiny_checkpoint):
    from tokenrelay.protocol.wire import JobRequest
    w = env.worker("w1", model=str(tiny_checkpoint("llama")), env=EAGER, **REAL)
    submit(env.r, env.keys, JobRequest(job_id="steady", prompt="Once upon a time", params={
        "temperature": 0, "max_tokens": 400, "ignore_eos": True}))
    wait_for(lambda: env.tokens_streamed(["steady"]) >= 5, 60, what="the steady job streaming")
    sent = time.monotonic()
    for name, params in hostile_jobs().items():
        submit(env.r, env.keys, JobRequest(job_id=name, prompt="x", params={
            "max_tokens": 16, **params}))
    reports = env.wait_ended(list(hostile_jobs()), timeout=60)
    took = time.monotonic() - sent
    for name, rep in reports.items():
        assert rep.kind == "error:invalid_request", (name, rep.kind)
        assert rep.terminal.message.startswith("params.structured_outputs"), rep.terminal.message
    assert took < 15, f"hostile jobs took {took:.1f} s to end (compile timeout 10 s)"
    during = len(env.streams(["steady"])["steady"].token_ids)
    steady = env.wait_ended(["steady"], timeout=120)["steady"]
    assert steady.kind == "done:length" and len(steady.token_ids) == 400 and not steady.problems
    assert during < 400, "the steady job should still have been streaming meanwhile"
    assert w.proc.poll() is None, "the worker died"
    gaps = _token_gaps(env, "steady")
    assert max(gaps) < 5.0, f"the steady job stalled {max(gaps):.1f} s"


def _token_gaps(env, job_id: str) -> list[float]:
    """Seconds between consecutive token events of a job (their ``ts``)."""
    from tokenrelay.protocol.keys import EVENT_FIELD
    from tokenrelay.protocol.wire import decode_event
    ts = [ev.ts for ev in (decode_event(f[EVENT_FIELD])
                           for _, f in env.r.xrange(env.keys.results(job_id)))
          if ev.type == "token"]
    return [b - a for a, b in zip(ts, ts[1:])] or [0.0]
