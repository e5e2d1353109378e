"""The one result-stream fold (protocol ``ResultFold``), property-tested on random event sequences.

Two readers fold a job's result stream: the SDK's ``JobState`` (what a producer is shown) and the
worker's resume-read (``worker.recovery.progress_from_entries``: what a worker taking the job over
continues from). They must agree on every stream, or a resumed job continues the engine from
other text than the client holds. No Redis needed: entries are built in memory.
"""

from __future__ import annotations

from typing import Any

import msgpack
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenrelay.producer_sdk.jobs.job import JobState
from tokenrelay.protocol.fold import ResultFold
from tokenrelay.protocol.keys import EVENT_FIELD
from tokenrelay.worker.recovery import progress_from_entries

_text = st.text(alphabet="abcé ", max_size=3)
_ids = st.lists(st.integers(0, 50), max_size=3)


def _entries(events: list[dict[str, Any]]) -> list[tuple[bytes, dict]]:
    return [(f"{1000 + i}-0".encode(), {EVENT_FIELD: msgpack.packb(e, use_bin_type=True)})
            for i, e in enumerate(events)]


def _token(seq: int, index: int, text: str, ids: list[int]) -> dict[str, Any]:
    return {"type": "token", "seq": seq, "position": index, "text": text, "token_ids": ids,
            "ts": 1.0}


@st.composite
def clean_outputs(draw) -> list[dict[str, Any]]:
    """The token events of one correct run: seq 0.., index = tokens before."""
    events, index = [], 0
    for seq in range(draw(st.integers(0, 8))):
        text, ids = draw(_text), draw(_ids)
        events.append(_token(seq, index, text, ids))
        index += len(ids)
    return events


def as_written(draw: Any, clean: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``clean`` token events as workers may really write them: retried writes (duplicates of
    earlier events) and takeovers (a new ``started``, then the attempt re-emits from its resume
    point, which may lie before what was already written); no terminal event yet."""
    stream: list[dict[str, Any]] = [{"type": "started", "worker_id": "w1", "attempt": 1,
                                     "seed": 7, "ts": 1.0}]
    attempt, i = 1, 0
    while i < len(clean):
        stream.append(clean[i])
        i += 1
        action = draw(st.sampled_from(["next", "next", "dup", "resume"]))
        if action == "dup":
            stream.append(clean[draw(st.integers(0, i - 1))])
        elif action == "resume":
            attempt += 1
            stream.append({"type": "started", "worker_id": f"w{attempt}", "attempt": attempt,
                           "seed": 7, "resumed_tokens": 0, "ts": 1.0})
            i = draw(st.integers(0, i))  # re-emit from the resume point on
    return stream


@st.composite
def observed_streams(draw) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(clean token events, a stream of them as workers may really write it): retried writes
    (duplicates of earlier events), takeovers (a new ``started``, then the attempt re-emits
    from its resume point, which may lie before what was already written), a terminal event
    and late writes after it."""
    clean = draw(clean_outputs())
    stream = as_written(draw, clean)
    stream.append({"type": "done", "finish_reason": "length", "ts": 1.0})
    stream.extend(draw(st.lists(st.sampled_from(clean or [_token(0, 0, "z", [1])]), max_size=2)))
    return clean, stream


@st.composite
def arbitrary_streams(draw) -> list[dict[str, Any]]:
    """Any mix of events, with seq and index values that need not make sense."""
    kinds = st.one_of(
        st.builds(_token, st.integers(0, 6), st.integers(0, 12), _text, _ids),
        st.builds(lambda a, s: {"type": "started", "worker_id": "w", "attempt": a, "seed": s,
                                "ts": 1.0}, st.integers(1, 4), st.one_of(st.none(),
                                                                         st.integers(0, 9))),
        st.just({"type": "done", "finish_reason": "stop", "ts": 1.0}),
        st.just({"type": "error", "code": "internal", "message": "x", "ts": 1.0}),
        st.just({"type": "future-event", "ts": 1.0}))
    return draw(st.lists(kinds, max_size=14))


def _sdk_fold(entries: list, cuts: list[int]) -> tuple[JobState, list]:
    """Feed a JobState in chunks (as XREAD delivers), with an overlapping re-read at each cut
    (a second reader or a retried read); return it and every delta it produced."""
    state, deltas, start = JobState("j", "k"), [], 0
    for cut in sorted(cuts) + [len(entries)]:
        deltas += state.feed(entries[max(0, start - 1):cut])
        start = cut
    return state, deltas


@settings(max_examples=300, deadline=None)
@given(observed_streams(), st.lists(st.integers(0, 40), max_size=4))
def test_duplicates_and_resumes_fold_to_the_clean_output(pair, cuts):
    clean, stream = pair
    entries = _entries(stream)
    want_text = "".join(e["text"] for e in clean)
    want_ids = [t for e in clean for t in e["token_ids"]]
    state, deltas = _sdk_fold(entries, cuts)
    result = state.result()
    assert (result.text, result.token_ids) == (want_text, want_ids)
    assert "".join(d.text for d in deltas) == want_text
    assert [d.seq for d in deltas] == list(range(len(clean)))
    prog = progress_from_entries(entries)
    assert (prog.text, prog.token_ids, prog.next_seq) == (want_text, want_ids, len(clean))
    assert prog.attempts == result.attempts == max(e.get("attempt", 0) for e in stream)


@settings(max_examples=300, deadline=None)
@given(observed_streams(), st.integers(0, 60))
def test_resume_point_is_aligned_with_what_the_client_holds(pair, cut):
    """A worker taking over after any prefix continues at next_seq with index = len(token_ids),
    and the text it hands the engine belongs to exactly those tokens."""
    clean, stream = pair
    prefix = _entries(stream)[:cut]
    prog = progress_from_entries(prefix)
    done = clean[:prog.next_seq]
    assert prog.token_ids == [t for e in done for t in e["token_ids"]]
    assert prog.text == "".join(e["text"] for e in done)
    state, _ = _sdk_fold(prefix, [])
    assert (state.fold.text, state.fold.token_ids) == (prog.text, prog.token_ids)


def _model(stream: list[dict[str, Any]]) -> tuple[str, list[int], int, int]:
    """The documented rule, written out plainly: token events with a new highest seq are
    appended whole; nothing after the first terminal event counts."""
    text, ids, next_seq, attempts = "", [], 0, 0
    for e in stream:
        if e["type"] in ("done", "error"):
            break
        if e["type"] == "started":
            attempts = max(attempts + 1, e["attempt"])
        if e["type"] == "token" and e["seq"] >= next_seq:
            text, ids, next_seq = text + e["text"], ids + e["token_ids"], e["seq"] + 1
    return text, ids, next_seq, attempts


@settings(max_examples=300, deadline=None)
@given(arbitrary_streams(), st.lists(st.integers(0, 20), max_size=3))
def test_sdk_and_recovery_agree_on_any_stream(stream, cuts):
    entries = _entries(stream)
    text, ids, next_seq, attempts = _model(stream)
    prog = progress_from_entries(entries)
    state, deltas = _sdk_fold(entries, cuts)
    assert (prog.text, prog.token_ids, prog.next_seq, prog.attempts) == \
        (text, ids, next_seq, attempts)
    assert (state.fold.text, state.fold.token_ids, state.fold.next_seq, state.attempts) == \
        (text, ids, next_seq, attempts)
    assert (prog.terminal is None) == (state.terminal is None)
    assert prog.seed == state.seed
    if not (state.terminal is not None and state.terminal.type == "done"
            and state.terminal.text):
        assert "".join(d.text for d in deltas) == text


def test_a_late_token_after_the_terminal_event_is_ignored_by_both():
    stream = [_token(0, 0, "a", [1]), {"type": "done", "finish_reason": "stop", "ts": 1.0},
              _token(1, 1, "LATE", [2])]
    prog = progress_from_entries(_entries(stream))
    fold = ResultFold()
    for e in stream:
        fold.apply(e)
    assert prog.text == fold.text == "a" and prog.token_ids == fold.token_ids == [1]


def test_regrouped_reemission_keeps_text_and_ids_together():
    """A resumed attempt whose first event starts before the folded tokens (index 1 < 2) but
    carries a new seq: ids and text are appended together, never cut apart."""
    stream = [_token(0, 0, "ab", [1, 2]), _token(1, 1, "bc", [2, 3])]
    prog = progress_from_entries(_entries(stream))
    assert prog.text == "abbc" and prog.token_ids == [1, 2, 2, 3]


# ------------------------------------------------------------------------------------------
# several choices (n > 1, beam search): one seq for the job, output folded per choice
# ------------------------------------------------------------------------------------------

def _choice_token(seq: int, choice: int, position: int, text: str, ids: list[int],
                  reason: Any = None) -> dict[str, Any]:
    ev = {"type": "token", "seq": seq, "choice": choice, "position": position, "text": text,
          "token_ids": ids, "ts": 1.0}
    if reason is not None:
        ev["finish_reason"] = reason
    return ev


@st.composite
def interleaved_outputs(draw) -> list[dict[str, Any]]:
    """One correct run of a job with 1-3 choices: per step, the choices still running in a
    random order each get a token event; a choice's last event carries its finish_reason."""
    lengths = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    made = [0] * len(lengths)
    positions = [0] * len(lengths)
    events: list[dict[str, Any]] = []
    while any(m < n for m, n in zip(made, lengths)):
        running = [i for i, (m, n) in enumerate(zip(made, lengths)) if m < n]
        for i in draw(st.permutations(running)):
            ids = draw(_ids)
            made[i] += 1
            reason = "length" if made[i] == lengths[i] else None
            events.append(_choice_token(len(events), i, positions[i], draw(_text), ids, reason))
            positions[i] += len(ids)
    return events


@st.composite
def observed_interleaved(draw):
    """(clean events, the stream as workers may write it: duplicates and takeovers)."""
    clean = draw(interleaved_outputs())
    stream = as_written(draw, clean)
    stream.append({"type": "done", "finish_reason": "length", "ts": 1.0,
                   "choices": [{"index": c, "finish_reason": "length"}
                               for c in sorted({e["choice"] for e in clean})]})
    return clean, stream


def _per_choice(events: list[dict[str, Any]]) -> dict[int, tuple[str, list[int]]]:
    out: dict[int, tuple[str, list[int]]] = {}
    for e in events:
        text, ids = out.get(e["choice"], ("", []))
        out[e["choice"]] = (text + e["text"], ids + e["token_ids"])
    return out


@settings(max_examples=200, deadline=None)
@given(observed_interleaved(), st.lists(st.integers(0, 40), max_size=4))
def test_interleaved_choices_fold_to_each_clean_output(pair, cuts):
    clean, stream = pair
    want = _per_choice(clean)
    entries = _entries(stream)
    state, deltas = _sdk_fold(entries, cuts)
    result = state.result()
    assert {o.index: (o.text, o.token_ids) for o in result.outputs} == want
    assert all(o.finish_reason == "length" for o in result.outputs)
    assert (result.text, result.token_ids) == want[0]
    assert _per_choice([{"choice": d.index, "text": d.text, "token_ids": d.token_ids}
                        for d in deltas]) == want
    assert [d.seq for d in deltas] == list(range(len(clean)))
    assert [(d.index, d.position) for d in deltas] == [(e["choice"], e["position"])
                                                       for e in clean]
    prog = progress_from_entries(entries)
    assert {i: (c.text, c.token_ids) for i, c in prog.choices.items()} == want
    assert prog.next_seq == len(clean)


@settings(max_examples=200, deadline=None)
@given(observed_interleaved(), st.integers(0, 60))
def test_a_takeover_after_any_prefix_knows_each_choice_and_which_finished(pair, cut):
    """What a worker resumes from (recovery) is what the client holds (SDK), choice by choice,
    and a choice counts as finished exactly when its last event is in the prefix."""
    clean, stream = pair
    prefix = _entries(stream)[:cut]
    prog = progress_from_entries(prefix)
    seen = clean[:prog.next_seq]
    assert {i: (c.text, c.token_ids) for i, c in prog.choices.items()} == _per_choice(seen)
    ended = {e["choice"] for e in seen if e.get("finish_reason")}
    assert {i for i, c in prog.choices.items() if c.finish_reason} == ended
    state, _ = _sdk_fold(prefix, [])
    assert {i: (c.text, c.token_ids) for i, c in state.fold.choices.items()} == \
        {i: (c.text, c.token_ids) for i, c in prog.choices.items()}


def test_done_of_a_non_streaming_job_with_choices_is_one_delta_per_choice():
    done = {"type": "done", "finish_reason": "stop", "text": "ab", "token_ids": [1, 2],
            "usage": {"prompt_tokens": 1, "completion_tokens": 3}, "ts": 1.0,
            "choices": [{"index": 0, "finish_reason": "stop", "text": "ab", "token_ids": [1, 2],
                         "cumulative_logprob": -0.5},
                        {"index": 1, "finish_reason": "length", "text": "c", "token_ids": [3]}]}
    state, deltas = _sdk_fold(_entries([done]), [])
    assert [(d.index, d.text, d.finish_reason) for d in deltas] == [(0, "ab", "stop"),
                                                                    (1, "c", "length")]
    result = state.result()
    assert [(o.index, o.text, o.token_ids, o.finish_reason, o.cumulative_logprob)
            for o in result.outputs] == [(0, "ab", [1, 2], "stop", -0.5),
                                         (1, "c", [3], "length", None)]
    assert result.text == "ab" and result.usage.completion_tokens == 3


def test_an_older_writers_index_is_read_as_the_position():
    fold = ResultFold()
    (delta,) = fold.apply({"type": "token", "seq": 0, "index": 4, "text": "a", "token_ids": [1]})
    assert (delta.index, delta.position, fold.text) == (0, 4, "a")


def test_logprob_tokens_fold_into_token_logprobs_and_malformed_ones_are_refused():
    import pytest

    from tokenrelay.protocol.errors import ProtocolError
    ev = {"type": "token", "seq": 0, "position": 0, "text": "é", "token_ids": [5],
          "logprobs": [{7: -0.1, 5: -0.7}], "logprob_tokens": {5: ["é", b"\xc3\xa9"],
                                                               7: ["\ufffd", b"\xc3"]}}
    fold = ResultFold("j")
    (delta,) = fold.apply(ev)
    (t,) = delta.token_logprobs
    assert (t.token_id, t.token, t.bytes, t.logprob) == (5, "é", [0xC3, 0xA9], -0.7)
    assert [(a.token_id, a.token, a.bytes) for a in t.top_logprobs] == [
        (7, "\ufffd", [0xC3]), (5, "é", [0xC3, 0xA9])]
    assert fold.choice(0).token_logprobs == [t]
    old = ResultFold("j")                        # a writer from before logprob_tokens
    (d,) = old.apply({k: v for k, v in ev.items() if k != "logprob_tokens"})
    assert d.token_logprobs is None and d.logprobs == ev["logprobs"]
    for bad in ({5: ["é", b"x"]}, {5: ["é", "not bytes"], 7: ["a", b"a"]}, [1, 2]):
        with pytest.raises(ProtocolError):
            ResultFold("j").apply({**ev, "logprob_tokens": bad})
    with pytest.raises(ProtocolError):
        ResultFold("j").apply({**ev, "logprobs": [{7: -0.1}]})   # the chosen token unnamed
