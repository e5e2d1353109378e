"""``submit()``'s signature is written once (producer_sdk/jobs/signatures.py) and its job fields are
the models': both clients show it to ``help()`` and ``inspect``, and the async client's other
methods carry the sync ones' docs."""

from __future__ import annotations

import inspect
import pydoc

import pytest

from tokenrelay.producer_sdk import AsyncClient, Client
from tokenrelay.producer_sdk.jobs.job import AsyncJob, Job
from tokenrelay.producer_sdk.jobs.payloads import JOB_FIELDS, MODEL_DEFAULTS
from tokenrelay.producer_sdk.jobs.signatures import SEND_OPTIONS, bind_submit, submit
from tokenrelay.protocol.sampling_params import SamplingParams
from tokenrelay.protocol.wire import JobRequest


def test_the_job_fields_of_submit_are_the_models():
    named = [n for n, p in inspect.signature(submit).parameters.items()
             if n != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert set(named) - set(SEND_OPTIONS) == JOB_FIELDS
    assert JOB_FIELDS - {"deadline_s", "queue"} <= set(JobRequest.model_fields)
    for name in JOB_FIELDS & set(JobRequest.model_fields) - {"job_id"}:   # the SDK makes ids
        default = inspect.signature(submit).parameters[name].default
        assert default == MODEL_DEFAULTS[name] or (default is None and MODEL_DEFAULTS[name] == {})


@pytest.mark.parametrize("cls, job", [(Client, "Job"), (AsyncClient, "AsyncJob")])
def test_both_clients_show_the_one_signature_and_its_docs(cls, job):
    sig = inspect.signature(cls.submit)
    assert list(sig.parameters) == list(inspect.signature(submit).parameters)
    assert sig.return_annotation == job
    text = pydoc.render_doc(cls.submit)
    assert "routing_key" in text and "QueueFull" in text
    assert all(name in text for name in SamplingParams.model_fields)


def test_a_call_binds_as_the_signature_says():
    bound = bind_submit(("hi",), {"max_tokens": 3, "priority": 1})
    assert bound["prompt"] == "hi" and bound["max_tokens"] == 3 and bound["priority"] == 1
    assert bound["stream"] is True and bound["block"] is False and "sampling" not in bound
    with pytest.raises(TypeError, match="multiple values"):
        bind_submit(("hi",), {"prompt": "again"})
    with pytest.raises(TypeError, match="positional"):
        bind_submit(("hi", "there"), {})


@pytest.mark.parametrize("sync, async_", [(Client, AsyncClient), (Job, AsyncJob)])
def test_every_public_async_method_is_documented_as_its_sync_twin(sync, async_):
    public = [n for n, m in vars(async_).items()
              if inspect.isfunction(m) and not n.startswith("_")]
    assert public and set(public) <= set(dir(sync))
    for name in public:
        assert getattr(async_, name).__doc__ == getattr(sync, name).__doc__, name
