"""worker/jobs.py: a job's engine deltas become protocol events."""

from __future__ import annotations

import pytest

from tokenrelay.protocol.events import TokenEvent, encode_event
from tokenrelay.protocol.wire import JobRequest, decode_event
from tokenrelay.worker.entries import Entry
from tokenrelay.worker.jobs import Job
from tokenrelay.engine.outputs import RequestDelta


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


@pytest.mark.parametrize("lp, names", [
    (None, None), ([{5: -0.25, 7: -1.5}], None),
    ([{5: -0.25, 7: -1.5}], {5: ("é", b"\xc3\xa9"), 7: ("\ufffd", b"\xc3")})])
@pytest.mark.parametrize("end", [{}, {"finish_reason": "length"},
                                 {"finish_reason": "stop", "stop_reason": "!",
                                  "cumulative_logprob": -1.25},
                                 {"finish_reason": "stop", "stop_reason": 7}])
@pytest.mark.parametrize("choice", [0, 2])
def test_fast_token_encoding_is_byte_equal_to_the_model(lp, names, end, choice):
    from tokenrelay.worker.jobs import encode_token_event
    fast = encode_token_event(3, choice, 9, "é", [5], lp, 12.5, end.get("finish_reason"),
                              end.get("stop_reason"), end.get("cumulative_logprob"), names)
    slow = encode_event(TokenEvent(seq=3, choice=choice, position=9, text="é", token_ids=[5],
                                   logprobs=lp, logprob_tokens=names, ts=12.5, **end))
    assert fast == slow
    assert decode_event(fast) == decode_event(slow)


def test_batch_id_is_unique_per_owner_and_batch():
    job = _job()
    first = job.batch_id
    job.batch_no += 1
    assert job.batch_id != first and job.batch_id.startswith("tok.")


def test_usage_total_tokens_is_on_the_wire_and_derived_for_older_writers():
    import msgpack

    from tokenrelay.protocol.events import DoneEvent, Usage
    wire = msgpack.unpackb(encode_event(DoneEvent(finish_reason="stop",
                                                  usage=Usage(prompt_tokens=5,
                                                              completion_tokens=2))))
    assert wire["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    older = msgpack.packb({"type": "done", "finish_reason": "stop",
                           "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
    assert decode_event(older).usage.total_tokens == 7


# ------------------------------------------------------------------------------------------
# several choices
# ------------------------------------------------------------------------------------------

def _choice_delta(index, ids, finished=False, reason="length", cum=None):
    return RequestDelta("j", ids, "".join(chr(96 + i) for i in ids), None, [], finished,
                        reason if finished else None, None, 3, 2 if finished else 1,
                        index=index, cumulative_logprob=cum)


def _several(n: int, **kw) -> Job:
    job = _job(**kw)
    job.shape(n, several=True)
    return job


def test_each_choice_streams_with_its_index_and_position_and_its_end():
    job = _several(2)
    job.on_delta(_choice_delta(1, [1]), 1.0)
    job.on_delta(_choice_delta(0, [2]), 1.0)
    job.on_delta(_choice_delta(1, [3], True, "stop", -1.5), 2.0)
    assert job.terminal is None            # choice 0 still runs
    job.on_delta(_choice_delta(0, [4], True), 3.0)
    evs = [decode_event(b) for b in job.pending]
    tokens = [e for e in evs if e.type == "token"]
    assert [(e.seq, e.choice, e.position, e.finish_reason) for e in tokens] == [
        (0, 1, 0, None), (1, 0, 0, None), (2, 1, 1, "stop"), (3, 0, 1, "length")]
    assert tokens[2].cumulative_logprob == -1.5
    (done,) = [e for e in evs if e.type == "done"]
    assert done.finish_reason == "length"              # choice 0's
    assert [(c.index, c.finish_reason, c.completion_tokens) for c in done.choices] == [
        (0, "length", 2), (1, "stop", 2)]
    assert done.usage.completion_tokens == 4 and done.text is None


def test_a_choice_that_ends_without_output_still_says_so_while_others_run():
    job = _several(2)
    job.on_delta(_choice_delta(0, [1]), 1.0)
    job.on_delta(_choice_delta(0, [], True, "stop"), 2.0)    # e.g. a trimmed stop string
    evs = [decode_event(b) for b in job.pending]
    assert [(e.choice, e.token_ids, e.finish_reason) for e in evs] == [(0, [1], None),
                                                                       (0, [], "stop")]


def test_non_streaming_choices_are_in_the_done_event():
    job = _several(2, stream=False)
    job.on_delta(_choice_delta(0, [1], True), 1.0)
    job.on_delta(_choice_delta(1, [2, 3], True), 1.0)
    (done,) = [decode_event(b) for b in job.pending]
    assert [(c.index, c.text, c.token_ids) for c in done.choices] == [(0, "a", [1]),
                                                                      (1, "bc", [2, 3])]
    assert (done.text, done.token_ids) == ("a", [1])


def test_cancel_ends_every_running_choice_and_keeps_the_finished_ones():
    job = _several(2)
    job.on_delta(_choice_delta(0, [1], True, "stop"), 1.0)
    job.on_delta(_choice_delta(1, [2]), 1.0)
    job.finish("cancelled")
    done = decode_event(job.pending[-1])
    assert done.finish_reason == "cancelled"
    assert [(c.index, c.finish_reason) for c in done.choices] == [(0, "stop"), (1, "cancelled")]
    assert done.usage.completion_tokens == 3


def test_a_rerun_beam_search_writes_only_the_beams_the_stream_lacks():
    """A takeover of a beam job reruns it; the beams already delivered (finished in the fold)
    are dropped, so the stream holds each beam once."""
    job = _several(2)
    job.choices[0].ids, job.choices[0].finish_reason = [1, 2], "length"   # already delivered
    job.next_seq = 1
    job.on_delta(_choice_delta(0, [1, 2], True), 1.0)
    job.on_delta(_choice_delta(1, [3, 4], True), 1.0)
    evs = [decode_event(b) for b in job.pending]
    assert [(e.type, getattr(e, "choice", None), getattr(e, "seq", None)) for e in evs] == [
        ("token", 1, 1), ("done", None, None)]
