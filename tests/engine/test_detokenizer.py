"""Incremental detokenizer: UTF-8 splits, stop strings across tokens, special tokens, replay."""

from __future__ import annotations

from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenrelay.engine.detokenizer import IncrementalDetokenizer, StopMatcher, detokenize_step
from tokenrelay.engine.loader import load_tokenizer
from tokenrelay.engine.sampling_params import SamplingParams

TEXTS = [
    "Hello world, this is a test of the incremental detokenizer.",
    "你好，世界！今天天气很好。",
    "emoji 🙂🚀 and accents: café naïve — done",
]


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint("llama"))


def stream(tok, text: str, params: SamplingParams, prompt: str = "Say:") -> tuple[list[str], IncrementalDetokenizer]:
    prompt_ids = tok.encode(prompt)
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, prompt_ids, params)
    deltas = []
    for t in ids:
        delta, stop = d.add([t])
        deltas.append(delta)
        if stop is not None:
            return deltas, d
    deltas.append(d.flush())
    return deltas, d


@pytest.mark.parametrize("text", TEXTS)
def test_concatenated_deltas_equal_full_decode(tok, text):
    deltas, _ = stream(tok, text, SamplingParams())
    ids = tok.encode(text, add_special_tokens=False)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_character_split_over_tokens_is_held_back(tok):
    text = "你好世界🙂"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text), "the tiny tokenizer should split these characters into bytes"
    deltas, _ = stream(tok, text, SamplingParams())
    assert "" in deltas[:-1]                      # some token ended mid-character
    assert "".join(deltas) == text


def test_stop_string_across_tokens_is_trimmed(tok):
    text = "alpha beta STOPWORD gamma delta"
    deltas, d = stream(tok, text, SamplingParams(stop=["STOPWORD"]))
    assert "".join(deltas) == "alpha beta "
    assert d.stopped == "STOPWORD"
    deltas, d = stream(tok, text, SamplingParams(stop=["STOPWORD"], include_stop_str_in_output=True))
    assert "".join(deltas) == "alpha beta STOPWORD"


def test_partial_stop_match_is_held_then_released(tok):
    text = "one two thr four"
    deltas, d = stream(tok, text, SamplingParams(stop=["three"]))
    assert d.stopped is None and "".join(deltas) == text
    # While "thr" might still become "three", it is not emitted.
    pos = 0
    for delta in deltas:
        pos += len(delta)
        assert not text[:pos].endswith(("t", "th", "thr")) or pos == len(text)


def test_earliest_of_several_stop_strings_wins(tok):
    deltas, d = stream(tok, "a b c d e", SamplingParams(stop=["d e", "b"]))
    assert "".join(deltas) == "a " and d.stopped == "b"


def test_skip_special_tokens(tok):
    ids = tok.encode("hi", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    for skip in (True, False):
        d = IncrementalDetokenizer(tok, [1], SamplingParams(skip_special_tokens=skip))
        text = "".join(d.add([t])[0] for t in ids) + d.flush()
        assert ("<|im_end|>" in text) is (not skip)


def test_replay_continues_exactly(tok):
    text = "你好，世界 and more words STOP here"
    params = SamplingParams(stop=["STOP"])
    prompt_ids = tok.encode("Say:")
    ids = tok.encode(text, add_special_tokens=False)
    full, _ = stream(tok, text, params)
    for k in (1, 3, len(ids) // 2):
        first = IncrementalDetokenizer(tok, prompt_ids, params)
        emitted = "".join(first.add([t])[0] for t in ids[:k])
        resumed = IncrementalDetokenizer(tok, prompt_ids, params)
        resumed.replay(ids[:k], emitted)
        rest = []
        for t in ids[k:]:
            delta, stop = resumed.add([t])
            rest.append(delta)
            if stop:
                break
        assert emitted + "".join(rest) == "".join(full)


def test_batched_step_matches_one_by_one(tok):
    params = [SamplingParams(), SamplingParams(skip_special_tokens=False), SamplingParams(stop=["o w"])]
    ids = [tok.encode(t, add_special_tokens=False) for t in ("hello world", "你好世界", "foo world")]
    singles = [IncrementalDetokenizer(tok, [1, 2], p) for p in params]
    batched = [IncrementalDetokenizer(tok, [1, 2], p) for p in params]
    for step in range(max(map(len, ids))):
        live = [i for i in range(3) if step < len(ids[i])]
        got = detokenize_step([(batched[i], [ids[i][step]], False) for i in live])
        want = [singles[i].add([ids[i][step]]) for i in live]
        assert got == want


# -- stop strings against a reference --------------------------------------------------------
# The engine's stop check is indexed per request (StopMatcher) and looks only at the window a
# step can complete. ``ReferenceStops`` is the plain algorithm it replaced, kept here as the
# specification: every stop searched in all not-yet-emitted text, the earliest occurrence wins
# (ties: the stop listed first), and the longest tail that is a prefix of a stop held back.

class PieceTokenizer:
    """Token i decodes to ``pieces[i]``: feeds the detokenizer exact text deltas."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def batch_decode(self, batches, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return ["".join(self.pieces[i] for i in ids) for ids in batches]


class ReferenceStops:
    def __init__(self, stops: list[str], include: bool) -> None:
        self.stops, self.include = stops, include
        self.text, self.emitted, self.stopped = "", 0, None

    def feed(self, delta: str, final: bool = False) -> tuple[str, Optional[str]]:
        self.text += delta
        if self.stopped is not None:
            return "", None
        hits = [(self.text.find(s, self.emitted), rank, s) for rank, s in enumerate(self.stops)]
        hits = [h for h in hits if h[0] >= 0]
        if hits:
            i, _, s = min(hits)
            end = i + len(s) if self.include else i
            out, self.emitted, self.stopped = self.text[self.emitted:end], end, s
            return out, s
        upto = len(self.text)
        if not final:
            longest = max(map(len, self.stops))
            for n in range(min(longest - 1, len(self.text) - self.emitted), 0, -1):
                if any(s.startswith(self.text[-n:]) for s in self.stops):
                    upto -= n
                    break
        out, self.emitted = self.text[self.emitted:upto], max(self.emitted, upto)
        return out, None


def run_pieces(pieces: list[str], stops: list[str], include: bool = False,
               matcher: Optional[StopMatcher] = None) -> list[tuple[str, Optional[str]]]:
    """(delta, stop) per piece, then the final flush, until a stop matches."""
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    d = IncrementalDetokenizer(PieceTokenizer(pieces), [], params)
    if matcher is not None:
        d.stops = matcher
    out = []
    for i in range(len(pieces)):
        out.append(d.add([i]))
        if out[-1][1] is not None:
            return out
    out.append(d.add([], final=True))
    return out


def reference_pieces(pieces: list[str], stops: list[str], include: bool = False
                     ) -> list[tuple[str, Optional[str]]]:
    ref = ReferenceStops(stops, include)
    out = []
    for p in pieces:
        out.append(ref.feed(p))
        if out[-1][1] is not None:
            return out
    out.append(ref.feed("", final=True))
    return out


ALPHABET = "ab é你🙂"
pieces_st = st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=14)
stops_st = st.lists(st.text(ALPHABET, min_size=1, max_size=6), min_size=1, max_size=6)


@pytest.mark.timeout(120)
@settings(max_examples=400, deadline=None)
@given(pieces=pieces_st, stops=stops_st, include=st.booleans())
def test_stop_deltas_match_the_reference(pieces, stops, include):
    assert run_pieces(pieces, stops, include) == reference_pieces(pieces, stops, include)


@pytest.mark.parametrize("pieces, stops, include, want", [
    # the earliest start wins, whatever the list order
    (["xabcdy"], ["bc", "abcd"], False, ("x", "abcd")),
    # ...but a stop is reported as soon as it completes: a longer one starting earlier that is
    # still incomplete at that step does not wait for more text
    (["xab", "c", "d"], ["abcd", "bc"], False, ("xa", "bc")),
    # at one start, the stop listed first wins
    (["abc"], ["ab", "abc"], True, ("ab", "ab")),
    (["abc"], ["abc", "ab"], True, ("abc", "abc")),
    # overlapping occurrences of one stop: the first one
    (["aaaa"], ["aa"], True, ("aa", "aa")),
    # split over three deltas, with and without the stop in the output
    (["xx ST", "O", "P yy"], ["STOP"], False, ("xx ", "STOP")),
    (["xx ST", "O", "P yy"], ["STOP"], True, ("xx STOP", "STOP")),
    # a held-back prefix that does not become the stop is released
    (["xx ST", "O", "NE"], ["STOP"], False, ("xx STONE", None)),
    # multi-character stops of non-ASCII text
    (["你好，世", "界！"], ["世界"], False, ("你好，", "世界")),
    (["emoji 🙂", "🚀 and"], ["🙂🚀"], True, ("emoji 🙂🚀", "🙂🚀")),
])
def test_stop_cases(pieces, stops, include, want):
    got = run_pieces(pieces, stops, include)
    assert ("".join(d for d, _ in got), got[-1][1]) == want
    assert got == reference_pieces(pieces, stops, include)


def test_held_back_text_waits_for_the_next_delta():
    got = run_pieces(["xx ST", "O", "P yy"], ["STOP"], False)
    assert [d for d, _ in got] == ["xx ", "", ""]


@pytest.mark.parametrize("text, stop", [("你好，世界！今天天气很好。", "世界"),
                                        ("emoji 🙂🚀 and accents", "🚀"),
                                        ("accents: café naïve — done", "é n")])
@pytest.mark.parametrize("include", [False, True])
def test_multibyte_stop_with_byte_level_tokens(tok, text, stop, include):
    deltas, d = stream(tok, text, SamplingParams(stop=[stop], include_stop_str_in_output=include))
    cut = text.index(stop) + (len(stop) if include else 0)
    assert "".join(deltas) == text[:cut] and d.stopped == stop
    assert not any("\ufffd" in x for x in deltas)


def test_stop_matcher_rejects_empty_stops():
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher(["ok", ""])
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher([])


# -- the window a step looks at is bounded ---------------------------------------------------

class RecordingMatcher(StopMatcher):
    """Records each step's window and how much of it was searched before."""

    def __init__(self, stops: list[str]) -> None:
        super().__init__(stops)
        self.calls: list[tuple[int, int]] = []

    def find(self, window: str, searched: int = 0):
        self.calls.append((len(window), searched))
        return super().find(window, searched)


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.text("aab", min_size=1, max_size=5), min_size=1, max_size=40),
       stops=st.lists(st.text("ab", min_size=1, max_size=12), min_size=1, max_size=6),
       include=st.booleans())
def test_a_step_searches_only_held_back_tail_and_new_text(pieces, stops, include):
    """Long runs of near matches (texts of mostly "a", stops of "a" and "b") keep tails held
    back; still each step's window is at most the longest stop minus one plus the new text,
    and only the new text is unsearched, however long the output grows."""
    matcher = RecordingMatcher(stops)
    got = run_pieces(pieces, stops, include, matcher)
    assert got == reference_pieces(pieces, stops, include)
    for (size, searched), piece in zip(matcher.calls, pieces):
        assert size <= matcher.max_len - 1 + len(piece)
        assert size - searched <= len(piece)


def test_many_stops_search_only_those_ending_in_the_new_text():
    """10,000 stops, none ending in "z": a step whose new text is "zz" looks at none of them."""
    stops = [f"{i:05d}" for i in range(10_000)]
    matcher = StopMatcher(stops)
    looked: list[str] = []

    class Window(str):
        def find(self, sub, *args):
            looked.append(sub)
            return str.find(self, sub, *args)

    assert matcher.find(Window("0000zz"), searched=4) is None and looked == []
    assert matcher.find(Window("0000zz7"), searched=6) is None
    assert 0 < len(looked) <= 1000                # only the stops ending in "7"
    assert matcher.find(Window("x01237"), searched=5) == (1, "01237")


def test_one_token_windows_come_from_the_memo_and_equal_a_fresh_decode(tok):
    from tokenrelay.engine import detokenizer
    ids = tok.encode("memo check: a few words", add_special_tokens=False)
    got = detokenizer._decode_batch(tok, [[t] for t in ids] + [ids], True)
    memo = detokenizer._SINGLE[tok._tokenizer]
    assert {(True, t) for t in ids} <= memo.keys()
    assert got == [tok._tokenizer.decode([t], skip_special_tokens=True) for t in ids] + [
        tok._tokenizer.decode(ids, skip_special_tokens=True)]
    memo[(True, ids[0])] = "<from the memo>"      # a second call reads it, not the tokenizer
    assert detokenizer._decode_batch(tok, [[ids[0]]], True) == ["<from the memo>"]
    del memo[(True, ids[0])]
