"""worker/jobs.py: a job's engine deltas become protocol events (moved out of
tests/worker/test_protocol.py, which covers the wire protocol only)."""

from __future__ import annotations

import pytest

from producer_sdk.protocol import JobRequest, TokenEvent, decode_event, encode_event
from worker.pending import Entry
from worker.jobs import Job
from engine.outputs import RequestDelta


# ------------------------------------------------------------------------------------------
# job bookkeeping -> events
# ------------------------------------------------------------------------------------------

def _job(**kw) -> Job:
    req = JobRequest(job_id="j", prompt="p", **kw)
    return Job(entry=Entry("default", "ns:jobs:q", "1000-0", {b"data": b""}), request=req,
               owner="w:tok", worker_id="w")


def _delta(ids, text, finished=False, n_out=0):
    return RequestDelta("j", ids, text, None, [], finished, "length" if finished else None, None, 3,
                     n_out)


def test_job_events_stream_and_final():
    job = _job(metadata={"a": 1})
    job.queue_started()
    assert job.on_delta(_delta([5], "x", n_out=1), 1.0) is True
    assert job.on_delta(_delta([6, 7], "yz", True, 3), 1.5) is False
    evs = [decode_event(b) for b in job.pending]
    assert [e.type for e in evs] == ["started", "token", "token", "done"]
    assert (evs[2].seq, evs[2].position, evs[2].token_ids) == (1, 1, [6, 7])
    assert evs[3].usage.completion_tokens == 3 and evs[3].metadata == {"a": 1}
    assert evs[3].usage.total_tokens == 3 + 3          # prompt + completion, as OpenAI names it
    assert evs[3].text is None  # streamed jobs do not repeat the text


def test_non_streaming_job_carries_text_only_in_done():
    job = _job(stream=False)
    job.on_delta(_delta([5], "x", n_out=1), 1.0)
    job.on_delta(_delta([6], "y", True, 2), 2.0)
    evs = [decode_event(b) for b in job.pending]
    assert [e.type for e in evs] == ["done"]
    assert evs[0].text == "xy" and evs[0].token_ids == [5, 6]


@pytest.mark.parametrize("lp", [None, [{5: -0.25, 7: -1.5}]])
@pytest.mark.parametrize("end", [{}, {"finish_reason": "length"},
                                 {"finish_reason": "stop", "stop_reason": "!",
                                  "cumulative_logprob": -1.25},
                                 {"finish_reason": "stop", "stop_reason": 7}])
@pytest.mark.parametrize("choice", [0, 2])
def test_fast_token_encoding_is_byte_equal_to_the_model(lp, end, choice):
    from worker.jobs import encode_token_event
    fast = encode_token_event(3, choice, 9, "é", [5], lp, 12.5, end.get("finish_reason"),
                              end.get("stop_reason"), end.get("cumulative_logprob"))
    slow = encode_event(TokenEvent(seq=3, choice=choice, position=9, text="é", token_ids=[5],
                                   logprobs=lp, ts=12.5, **end))
    assert fast == slow
    assert decode_event(fast) == decode_event(slow)


def test_batch_id_is_unique_per_owner_and_batch():
    job = _job()
    first = job.batch_id
    job.batch_no += 1
    assert job.batch_id != first and job.batch_id.startswith("tok.")


def test_usage_total_tokens_is_on_the_wire_and_derived_for_older_writers():
    import msgpack

    from producer_sdk.protocol import DoneEvent, Usage
    wire = msgpack.unpackb(encode_event(DoneEvent(finish_reason="stop",
                                                  usage=Usage(prompt_tokens=5,
                                                              completion_tokens=2))))
    assert wire["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    older = msgpack.packb({"type": "done", "finish_reason": "stop",
                           "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
    assert decode_event(older).usage.total_tokens == 7
