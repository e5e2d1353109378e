"""Incremental detokenizer: UTF-8 splits, stop strings across tokens, special tokens, replay."""

from __future__ import annotations

import pytest

from engine.detokenizer import IncrementalDetokenizer, detokenize_step
from engine.loader import load_tokenizer
from engine.sampling_params import SamplingParams

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
