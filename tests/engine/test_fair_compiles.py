"""One producer's backlog of slow-to-compile constraints does not delay another producer's
constrained job (issue #42): with 40 hostile specs of producer A queued first, producer B's
simple constrained job gets its first token within 2x of its time alone.

The hostile specs are counted repetitions of counted repetitions (``a{1000}{N}``), 40 distinct
ones so the compile cache cannot help: each really compiles for tens to hundreds of
milliseconds on the tiny model's tokenizer. The test checks that they are slow enough that a
first-come-first-served queue would break the 2x bound (their total compile time, spread over
the threads, is many times B's budget), so the bound is something fairness has to earn. Run
once against the old first-come pool it failed: B waited 8.66 s against 6 ms alone; with this
queue B took 3-21 ms against 7-15 ms alone (4 runs on the shared 2-core host). "Within 2x" is
asserted as 2x plus ``SLACK_S``: B alone takes a few milliseconds on the tiny model, less than
one stall of this host's scheduler.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

import pytest

from tokenrelay.engine import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = "Give me the record:"
HOSTILE = 40
THREADS = 2
ROUNDS = 3
# Slack on top of 2x for this shared 2-core host's scheduling noise: a few engine steps. A
# FIFO queue misses the bound by seconds (checked below from the measured compile times).
SLACK_S = 0.15


def hostile_spec(i: int) -> StructuredOutputsParams:
    """A regex whose lexer explodes; producers refuse it at submit now
    (protocol/grammar_probe.py), so it is built unvalidated: it stands for every spec that
    passes that check and is still slow at a worker."""
    return StructuredOutputsParams.model_construct(regex=f"a{{1000}}{{{1000 - i}}}")


def benign_spec(i: int) -> StructuredOutputsParams:
    """A small schema, distinct per call so every one compiles (no cache hit)."""
    return StructuredOutputsParams(json={
        "type": "object", "additionalProperties": False, "required": ["name", "n"],
        "properties": {"name": {"type": "string", "maxLength": 4 + i},
                       "n": {"type": "integer", "minimum": 0, "maximum": 9}}})


def params(spec: StructuredOutputsParams) -> SamplingParams:
    base = SamplingParams(temperature=0, max_tokens=4)
    return SamplingParams.model_construct(**{**base.__dict__, "structured_outputs": spec})


def first_tokens_s(engine: Any, name: str, specs: list[StructuredOutputsParams],
                   owner: Optional[str]) -> list[float]:
    """Add one request per spec at once, step the engine (as a worker does) until each has a
    token, abort it then; seconds from the add to each request's first token."""
    t0 = time.perf_counter()
    ids = [f"{name}-{k}" for k in range(len(specs))]
    for rid, spec in zip(ids, specs):
        engine.add_request(rid, PROMPT, params(spec), owner=owner)
    took: dict[str, float] = {}
    while len(took) < len(ids):
        for d in engine.step():
            assert d.error is None or d.request_id not in ids, d.error
            if d.request_id in ids and d.new_token_ids and d.request_id not in took:
                took[d.request_id] = time.perf_counter() - t0
                engine.abort_request(d.request_id)
        assert time.perf_counter() - t0 < 60, f"{name}: no first token within 60 s"
    return [took[r] for r in ids]


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Any) -> Any:
    from tokenrelay.engine import LLM
    eng = LLM(str(tiny_checkpoint("llama")), num_kv_blocks=256, block_size=8,
              grammar_compile_threads=THREADS, grammar_compile_timeout_s=120).engine
    first_tokens_s(eng, "warm-up", [benign_spec(100)], "B")   # the LLTokenizer, the threads
    return eng


@pytest.mark.timeout(300)
def test_a_hostile_backlog_does_not_delay_another_producers_first_token(engine):
    alone = statistics.median(first_tokens_s(
        engine, "alone", [benign_spec(k) for k in range(ROUNDS)], "B"))
    compiled_before = engine.stats()["grammar_compile_seconds"]
    for i in range(HOSTILE):
        engine.add_request(f"hostile-{i}", PROMPT, params(hostile_spec(i)), owner="A")
    loaded = first_tokens_s(engine, "loaded", [benign_spec(ROUNDS + k) for k in range(ROUNDS)],
                            "B")
    backlog_left = engine.stats()["grammar_compile_queued"]
    while any(r.startswith("hostile-") for r in engine.requests):   # A's backlog, to the end
        engine.step()
    hostile_s = engine.stats()["grammar_compile_seconds"] - compiled_before
    fifo_wait_s = hostile_s / THREADS       # what B would wait behind A's backlog, first come
    bound = 2 * alone + SLACK_S
    print(f"B alone {alone:.3f} s; B with A's backlog {[round(x, 3) for x in loaded]} s; "
          f"A's compiles {hostile_s:.2f} s (FIFO wait about {fifo_wait_s:.2f} s)")
    assert fifo_wait_s > 5 * bound, (f"the hostile specs compiled in {hostile_s:.2f} s: too "
                                     f"fast for this test to tell a fair queue from a FIFO")
    assert statistics.median(loaded) <= bound, (
        f"B's first token took {[round(x, 3) for x in loaded]} s with A's backlog queued, "
        f"{alone:.3f} s alone (bound {bound:.3f} s; A's compiles: {hostile_s:.2f} s)")
    assert backlog_left > 0, "A's backlog ran out before B was measured: nothing was tested"


@pytest.mark.timeout(120)
def test_an_owner_never_holds_more_than_its_share_of_threads(engine):
    """While A's backlog waits, A runs on at most half the threads: the rest stay free."""
    queue = engine.structured.compiler._queue
    for i in range(8):
        engine.add_request(f"share-{i}", PROMPT, params(hostile_spec(HOSTILE + i)), owner="A")
    seen = 0
    while any(r.startswith("share-") for r in engine.requests):
        seen = max(seen, queue.running().get("A", 0))
        engine.step()
    assert seen == queue.per_owner == THREADS // 2
