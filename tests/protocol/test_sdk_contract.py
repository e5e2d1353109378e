"""The SDK speaks the protocol module's contract: one payload validation (the fast bulk encoder is
proven equal to it), the same Limits before enqueue, and no engine or torch on the producer side."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenrelay.producer_sdk import Client, InvalidRequest
from tokenrelay.producer_sdk.jobs.payloads import PayloadBuilder
from tokenrelay.protocol.errors import ProtocolError
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.limits import Limits
from tokenrelay.protocol.wire import decode_job, validate_job
from tests.sdk_helpers import env_with_repo, sdk_redis, sdk_url  # noqa: F401

KEYS = Keys()

_sampling = st.fixed_dictionaries({}, optional={
    "max_tokens": st.one_of(st.integers(-1, 40), st.just("5")),
    "temperature": st.one_of(st.floats(-1, 3, allow_nan=False), st.integers(0, 2)),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=3), max_size=3),
                      st.just(5), st.just(True)),
    "seed": st.one_of(st.integers(0, 2**40), st.just(True)),
    "logprobs": st.integers(0, 25),
    "ignore_eos": st.one_of(st.booleans(), st.just("yes")),
    "stop_token_ids": st.lists(st.integers(-1, 9), max_size=3),
    "n": st.integers(0, 20),                                   # max_n is 16
    "beam_width": st.one_of(st.none(), st.integers(0, 20)),    # max_beam_width is 16
    "length_penalty": st.one_of(st.floats(-12, 12, allow_nan=False), st.just("1")),
})
_job_fields = st.fixed_dictionaries({}, optional={
    "priority": st.one_of(st.integers(-(2**32), 2**32), st.just(True), st.just(1.5)),
    "stream": st.one_of(st.booleans(), st.just("yes")),
    "metadata": st.dictionaries(st.text(max_size=4), st.one_of(st.integers(), st.text(max_size=8),
                                                               st.lists(st.integers(),
                                                                        max_size=3)),
                                max_size=3),
    "deadline_s": st.one_of(st.floats(0.001, 100), st.just(0)),
    "traceparent": st.sampled_from(["00-" + "a" * 32 + "-" + "b" * 16 + "-01", "not-a-trace"]),
    "routing_key": st.sampled_from(["conversation-7", ""]),
    "chat_template_kwargs": st.just({"enable_thinking": False}),   # a prompt job has none
})
_prompts = st.lists(st.text(max_size=30), min_size=1, max_size=4)


def _outcome(fn):
    try:
        return "ok", fn()
    except InvalidRequest as exc:
        return "invalid", exc.field


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_prompts, _sampling, _job_fields)
def test_fast_bulk_encoder_equals_the_pydantic_model(prompts, sampling, job_fields):
    """For any defaults, the spliced bulk payloads decode (worker side, ``decode_job``) to exactly
    the JobRequest that the protocol's validation builds from the same arguments, and the bulk
    path refuses exactly what that validation refuses."""
    builder = PayloadBuilder(KEYS)
    defaults = {**sampling, **job_fields}
    fast = _outcome(lambda: builder.build_many(prompts, defaults, 1_000))
    general = _outcome(lambda: [builder.build(prompt=p, submitted_ms=1_000, **defaults)
                                for p in prompts])
    assert fast[0] == general[0]
    if fast[0] == "invalid":
        assert fast[1] == general[1]
        return
    for prompt, p, g in zip(prompts, fast[1], general[1]):
        decoded = decode_job(p.payload)
        model = validate_job({**msgpack.unpackb(g.payload, raw=False), "job_id": p.job_id})
        assert decoded == model and decoded.prompt == prompt
        assert p.lane == g.lane == Keys.lane_for_priority(decoded.priority)
        assert p.stream == decoded.stream
        assert p.routing_key == g.routing_key == decoded.routing_key


def test_client_applies_the_limits_before_enqueue(sdk_url: str):
    r = redis.Redis.from_url(sdk_url)
    with Client(sdk_url, limits=Limits(max_stop_strings=1, max_prompt_bytes=10)) as client:
        with pytest.raises(InvalidRequest) as exc:
            client.submit("x", stop=["a", "b"])
        assert exc.value.field == "params.stop" and "max_stop_strings" in str(exc.value)
        with pytest.raises(InvalidRequest) as exc:
            client.submit_many(["short", "far too long for ten bytes"])  # bulk fast path
        assert exc.value.field == "prompt" and "max_prompt_bytes" in str(exc.value)
        assert sum(r.xlen(k) for k in KEYS.lanes()) == 0
        client.submit("fits", stop="a")
    with Client(sdk_url) as client:  # the defaults apply without asking
        with pytest.raises(InvalidRequest, match="max_stop_strings"):
            client.submit("x", stop=[f"s{i}" for i in range(65)])
        with pytest.raises(InvalidRequest, match="max_metadata_depth"):
            deep: dict = {}
            for _ in range(40):
                deep = {"d": deep}
            client.submit("x", metadata=deep)
    assert sum(r.xlen(k) for k in KEYS.lanes()) == 1
    r.close()


def test_sdk_and_worker_report_the_same_field():
    builder = PayloadBuilder(KEYS)
    for kwargs in ({"stream": "yes"}, {"max_tokens": "5"}, {"stop": 5}, {"priority": 2**31}):
        with pytest.raises(InvalidRequest) as sdk_err:
            builder.build("x", job_id="j1", **kwargs)
        raw = {"v": 1, "job_id": "j1", "prompt": "x", "params": {}}
        if "max_tokens" in kwargs or "stop" in kwargs:
            raw["params"] = kwargs
        else:
            raw.update(kwargs)
        with pytest.raises(ProtocolError) as worker_err:
            decode_job(msgpack.packb(raw))
        assert sdk_err.value.field.split(".")[-1] == worker_err.value.field.split(".")[-1]


def test_sampling_params_schema_imports_without_redis_or_engine():
    code = ("import sys; import tokenrelay.protocol.sampling_params, tokenrelay.protocol.wire, "
            "tokenrelay.protocol.fold, tokenrelay.protocol.events; "
            "bad = [m for m in ('redis', 'tokenrelay.engine', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, env=env_with_repo(), timeout=60)


def test_engine_reexports_the_same_schema():
    from tokenrelay.engine import SamplingParams as EngineParams
    from tokenrelay.engine.sampling_params import SamplingParams as ModuleParams
    from tokenrelay.protocol.sampling_params import SamplingParams
    assert EngineParams is SamplingParams and ModuleParams is SamplingParams


def test_submitting_imports_neither_engine_nor_torch(sdk_url: str):
    code = ("import sys; from tokenrelay.producer_sdk import Client; "
            f"c = Client({sdk_url!r}); c.submit('hi', max_tokens=3, stop='x'); "
            "c.submit_many(['a', 'b'], temperature=0); c.close(); "
            "bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('tokenrelay.engine')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, env=env_with_repo(), timeout=60)
