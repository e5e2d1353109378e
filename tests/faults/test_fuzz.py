"""Property-based fuzzing of one real worker (``tokenrelay worker --model fake:``) through Redis.

Random payloads go onto the lanes by raw XADD, as a hostile or buggy producer in any language
could send them: random msgpack structures, job-shaped maps with a random type in every field
(params fields included), huge and deeply nested values, and bytes that are not msgpack at all.
A valid job follows each one. The oracle, checked after every example:

* the worker process never exits;
* every payload whose top-level ``job_id`` is a valid id gets exactly one terminal event (done
  or error) on its result stream, and nothing after it;
* every valid job finishes with exactly the fake engine's output (worker.fake_engine).

Every job field is drawn, the optional ones (``chat_template_kwargs``, ``traceparent``,
``routing_key``) too.

One redis-server and one worker serve the whole module; every example uses fresh job ids.
Shrinking is off: each example costs real round trips, and the failure message prints the
payloads instead.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Optional

import msgpack
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tokenrelay.protocol.keys import PAYLOAD_FIELD
from tokenrelay.protocol.sampling_params import SamplingParams
from tests.fault_harness import FaultEnv, pending_summary, wait_for
from tokenrelay.worker.fake_engine import fake_completion

pytestmark = pytest.mark.timeout(240)
VALID_TOKENS = 4
_ids = itertools.count()


@dataclass(frozen=True)
class Payload:
    """One fuzz payload and what the oracle may expect of it."""

    raw: bytes
    job_id: Optional[str]      # the readable top-level job id, None when there is none
    what: str                  # short description for failure messages

    def __repr__(self) -> str:
        return f"Payload({self.what}, {len(self.raw)} bytes, job_id={self.job_id})"


def new_id(tag: str) -> str:
    return f"fz{next(_ids)}-{tag}"


# --------------------------------------------------------------------------------------------
# strategies
# --------------------------------------------------------------------------------------------

msgpack_ints = st.integers(min_value=-2**63, max_value=2**64 - 1)   # what msgpack can encode
scalars = st.one_of(
    st.none(), st.booleans(), msgpack_ints,
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
    st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.one_of(st.text(max_size=8), msgpack_ints),
                                                 inner, max_size=5)), max_leaves=20)
# values a field is "meant" to have, so that many payloads get past the first checks
plausible = {
    "v": st.just(1), "prompt": st.text(min_size=1, max_size=30),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                "content": st.text(max_size=20)}),
                         min_size=1, max_size=3),
    "prompt_token_ids": st.lists(st.integers(min_value=1, max_value=200), min_size=1,
                                 max_size=10),
    "priority": st.integers(min_value=-3, max_value=3), "stream": st.booleans(),
    "deadline_ms": st.sampled_from([0, 1, 2**62]), "submitted_ms": st.integers(0, 2**41),
    "metadata": st.dictionaries(st.text(max_size=8), scalars, max_size=3),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(
        ["enable_thinking", "tokenize", "add_generation_prompt", "x"]), scalars, max_size=3),
    "traceparent": st.sampled_from(["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                                    "00-xyz", ""]),
    "routing_key": st.one_of(st.text(min_size=1, max_size=40), st.just(""),
                             st.text(min_size=257, max_size=300)),
    "model": st.one_of(st.sampled_from(["fake", "smollm2"]), st.text(max_size=40), st.just(""),
                       st.text(min_size=257, max_size=300)),
    "producer": st.one_of(st.sampled_from(["team-a", "key-0123456789abcdef"]),
                          st.text(max_size=40), st.just(""), st.text(min_size=129, max_size=160)),
    "tools": st.lists(st.fixed_dictionaries({
        "type": st.sampled_from(["function", "x"]),
        "function": st.fixed_dictionaries({"name": st.text(max_size=12),
                                           "parameters": st.sampled_from([
                                               {"type": "object"}, {"type": 3}, {}])})}),
        max_size=3),
}
plausible_params = {
    "max_tokens": st.integers(min_value=0, max_value=12), "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1), "top_k": st.integers(-1, 50), "seed": st.integers(0, 2**32),
    "stop": st.lists(st.text(max_size=5), max_size=4), "n": st.integers(0, 4),
    "beam_width": st.one_of(st.none(), st.integers(0, 4)), "length_penalty": st.floats(-11, 11),
    "logprobs": st.integers(0, 30), "stop_token_ids": st.lists(st.integers(0, 300), max_size=4),
    "logit_bias": st.dictionaries(st.one_of(st.integers(-2, 2**40), st.text(max_size=4)),
                                  st.one_of(st.floats(-120, 120), st.booleans()), max_size=4),
    "structured_outputs": st.sampled_from([
        {"choice": ["yes", "no"]}, {"regex": "[a-z]{1,4}"}, {"json": {"type": "object"}},
        {"json_object": True}, {"regex": "("}, {"choice": []}, {"json": 3},
        {"choice": ["a"], "regex": "b"}]),
}


# Every JobRequest field but job_id and params, which job_maps draws on their own.
JOB_FIELDS = ("v", "prompt", "messages", "prompt_token_ids", "priority", "deadline_ms", "stream",
              "metadata", "submitted_ms", "chat_template_kwargs", "traceparent", "routing_key",
              "tools", "model", "producer")


def test_every_job_field_is_fuzzed():
    """A field added to the protocol is drawn here too, or this fails."""
    from tokenrelay.protocol.wire import JobRequest
    assert set(JOB_FIELDS) | {"job_id", "params"} == set(JobRequest.model_fields)


def field_value(name: str, table: dict) -> st.SearchStrategy:
    """Mostly a plausible value, sometimes a random one of any type."""
    if name in table:
        return st.one_of(table[name], table[name], values)
    return values


@st.composite
def job_maps(draw) -> Payload:
    """A job-shaped map with a random subset of fields, each plausible or of a random type."""
    job_id = new_id("map")
    obj: dict[Any, Any] = {}
    for name in JOB_FIELDS:
        if draw(st.integers(0, 9)) < (9 if name in ("v", "prompt") else 2):
            obj[name] = draw(field_value(name, plausible))
    if draw(st.booleans()):
        params = {}
        for name in SamplingParams.model_fields:
            if draw(st.integers(0, 9)) < 2:
                params[name] = draw(field_value(name, plausible_params))
        obj["params"] = params if draw(st.integers(0, 9)) else draw(values)
    if not draw(st.integers(0, 9)):
        obj[draw(st.text(min_size=1, max_size=8))] = draw(values)   # unknown field
    readable = draw(st.integers(0, 9)) > 0
    if readable:
        obj["job_id"] = job_id
    else:   # an unreadable id: wrong type, whitespace, braces, too long
        obj["job_id"] = draw(st.one_of(values, st.sampled_from(
            ["has space", "{brace}", "x" * 129, "", "tab\there"])))
    items = list(obj.items())
    order = draw(st.permutations(range(len(items))))
    raw = msgpack.packb(dict(items[i] for i in order), use_bin_type=True)
    return Payload(raw, job_id if readable else None, f"map keys={sorted(map(str, obj))}")


def _nested(depth: int, kind: str) -> bytes:
    """msgpack nested ``depth`` levels (maps or arrays) without recursion (msgpack-python's
    packer refuses such depth; producers in other languages do not)."""
    return (b"\x81\xa1k" if kind == "map" else b"\x91") * depth + b"\xc0"


def _map_with(pairs: list[tuple[str, bytes]]) -> bytes:
    return bytes([0x80 | len(pairs)]) + b"".join(msgpack.packb(k) + v for k, v in pairs)


@st.composite
def deep_payloads(draw) -> Payload:
    """A job whose metadata, params or prompt is nested up to 20,000 levels deep; the job id
    comes before or after the deep value."""
    job_id = new_id("deep")
    depth = draw(st.sampled_from([100, 600, 1100, 5000, 20_000]))
    kind = draw(st.sampled_from(["map", "array"]))
    where = draw(st.sampled_from(["metadata", "params", "prompt"]))
    pairs = [("v", msgpack.packb(1)), (where, _nested(depth, kind))]
    if where != "prompt":
        pairs.append(("prompt", msgpack.packb("deep")))
    pairs.insert(draw(st.integers(0, len(pairs))), ("job_id", msgpack.packb(job_id)))
    return Payload(_map_with(pairs), job_id, f"{where} {kind} nested {depth}")


HUGE = {
    "prompt 5 MB": lambda: {"prompt": "x" * 5_000_000},
    "prompt_token_ids 1.1M": lambda: {"prompt_token_ids": [7] * 1_100_000},
    "messages 20k": lambda: {"messages": [{"role": "user", "content": "m"}] * 20_000},
    "stop 10k": lambda: {"prompt": "p", "params": {"stop": ["s"] * 10_000}},
    "stop of 4 KB": lambda: {"prompt": "p", "params": {"stop": ["s" * 4096]}},
    "stop_token_ids 5k": lambda: {"prompt": "p", "params": {"stop_token_ids": [1] * 5000}},
    "metadata 100 KB": lambda: {"prompt": "p", "metadata": {"k": "v" * 100_000}},
    "logprobs 10^6": lambda: {"prompt": "p", "params": {"logprobs": 10**6}},
    "n 1000": lambda: {"prompt": "p", "params": {"n": 1000}},
    "max_tokens 2^40": lambda: {"prompt": "p", "params": {"max_tokens": 2**40}},
    "payload 9 MiB": lambda: {"prompt": "p", "metadata": {"pad": b"\0" * (9 * 2**20)}},
}


@st.composite
def huge_payloads(draw) -> Payload:
    """One of the unbounded costs of finding 6, as a job with a readable id."""
    name = draw(st.sampled_from(sorted(HUGE)))
    job_id = new_id("huge")
    body = {"v": 1, "job_id": job_id, **HUGE[name]()}
    return Payload(msgpack.packb(body, use_bin_type=True), job_id, name)


@st.composite
def raw_payloads(draw) -> Payload:
    """Bytes that are not a job map: random bytes, msgpack of a random non-map structure, or a
    valid job cut short."""
    kind = draw(st.sampled_from(["bytes", "structure", "truncated", "empty"]))
    if kind == "bytes":
        return Payload(draw(st.binary(min_size=1, max_size=300)), None, "random bytes")
    if kind == "structure":
        return Payload(msgpack.packb(draw(values), use_bin_type=True), None, "random msgpack")
    if kind == "empty":
        return Payload(b"", None, "empty")
    full = msgpack.packb({"v": 1, "prompt": "cut", "job_id": new_id("cut")}, use_bin_type=True)
    # The cut is drawn independently of len(full), which grows with the id counter: a draw
    # bounded by it made replays generate differently (hypothesis FlakyStrategyDefinition).
    return Payload(full[:draw(st.integers(0, 2**16)) % len(full)], None, "truncated job")


payloads = st.one_of(job_maps(), job_maps(), deep_payloads(), huge_payloads(), raw_payloads())


# --------------------------------------------------------------------------------------------
# the worker under test and the oracle
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def env(tmp_path_factory):
    e = FaultEnv(tmp_path_factory.mktemp("fuzz"), namespace="fuzz")
    try:
        e.worker("fz", delay=0.0, max_deliveries=2)
        yield e
    finally:
        e.close()


def valid_job(n: str) -> tuple[str, bytes]:
    job_id = new_id(f"ok{n}")
    body = {"v": 1, "job_id": job_id, "prompt": f"valid prompt {job_id}",
            "params": {"max_tokens": VALID_TOKENS, "temperature": 0.0}}
    return job_id, msgpack.packb(body, use_bin_type=True)


def send_and_check(env: FaultEnv, batch: list[Payload]) -> None:
    """XADD every payload followed by a valid job (random lanes), then apply the oracle."""
    lanes = env.keys.lanes()
    pipe = env.r.pipeline(transaction=False)
    valid = []
    for i, p in enumerate(batch):
        pipe.xadd(lanes[len(p.raw) % 3], {PAYLOAD_FIELD: p.raw})
        job_id, raw = valid_job(str(i))
        valid.append(job_id)
        pipe.xadd(lanes[i % 3], {PAYLOAD_FIELD: raw})
    pipe.execute()
    readable = [p.job_id for p in batch if p.job_id is not None]
    worker = env.workers[0]
    try:
        reports = env.wait_ended(valid + readable, timeout=60)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\nbatch: {batch}\nworker alive: "
                             f"{worker.proc.poll() is None}\n{env.logs()[-3000:]}") from None
    assert worker.proc.poll() is None, f"worker exited on {batch}:\n{env.logs()[-3000:]}"
    for job_id in valid:
        rep = reports[job_id]
        assert rep.kind == "done:length" and not rep.problems, (job_id, rep.kind, rep.problems)
        assert rep.text == fake_completion(f"valid prompt {job_id}", VALID_TOKENS), job_id
    for job_id in readable:   # ended, and a second terminal event would be a problem
        rep = reports[job_id]
        assert rep.ended and not rep.problems, (job_id, rep.kind, rep.problems, batch)


def fuzz_settings(examples: int):
    return settings(max_examples=examples, deadline=None, database=None,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=list(HealthCheck))


@fuzz_settings(30)
@given(batch=st.lists(payloads, min_size=1, max_size=4))
def test_fuzz_mixed_payloads(env, batch):
    send_and_check(env, batch)


@fuzz_settings(20)
@given(batch=st.lists(st.one_of(job_maps(), raw_payloads()), min_size=4, max_size=8))
def test_fuzz_bursts_of_maps_and_bytes(env, batch):
    send_and_check(env, batch)


@fuzz_settings(15)
@given(batch=st.lists(st.one_of(deep_payloads(), huge_payloads()), min_size=1, max_size=3))
def test_fuzz_deep_and_huge(env, batch):
    send_and_check(env, batch)


def test_worker_survived_and_nothing_is_left_pending(env):
    """After every batch (this runs last in the module): still the one worker process, and
    every entry acknowledged."""
    assert env.workers[0].proc.poll() is None, env.logs()[-3000:]
    wait_for(lambda: not pending_summary(env.r, env.keys), 30, what="every entry acknowledged")
