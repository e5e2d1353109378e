"""The output processor given several core steps at once (a core in its own process that ran
ahead): what a caller gets is what it gets step by step, with the deltas of each choice joined."""

from __future__ import annotations

import pytest

from tokenrelay.engine.loader import load_tokenizer
from tokenrelay.engine.output_processor import OutputProcessor
from tokenrelay.engine.outputs import CoreOutput, merge_deltas
from tokenrelay.engine.sampling_params import SamplingParams

TEXT = "Hello world, 你好 🙂 café — and the end of it. More after the end."


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint("llama"))


def core_steps(tok, params: dict[str, SamplingParams]) -> list[list[CoreOutput]]:
    """One output per request per step, the text's tokens one at a time; the last is final."""
    ids = tok.encode(TEXT, add_special_tokens=False)
    steps = []
    for k, t in enumerate(ids):
        last = k == len(ids) - 1
        steps.append([CoreOutput(rid, 0, [t], [], None, "length" if last else None, None, 3,
                                 k + 1, None, ends_request=last) for rid in params])
    return steps


def processor(tok, params: dict[str, SamplingParams]) -> OutputProcessor:
    op = OutputProcessor(tok)
    for rid, p in params.items():
        op.add(rid, tok.encode("Say:"), p)
    return op


def by_request(deltas) -> dict[str, tuple]:
    return {d.request_id: (d.new_token_ids, d.new_text, d.finished, d.finish_reason,
                           d.stop_reason, d.num_output_tokens) for d in merge_deltas(deltas)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("group", [1, 2, 3, 7, 1000])
def test_steps_taken_together_give_what_they_give_one_at_a_time(tok, group):
    params = {"plain": SamplingParams(max_tokens=100),
              "stops": SamplingParams(max_tokens=100, stop=["the end"])}
    steps = core_steps(tok, params)
    one = processor(tok, params)
    alone, alone_stops = [], []
    for outs in steps:
        done = one.process(outs)
        alone += done.deltas
        alone_stops += done.stops
    many = processor(tok, params)
    together, together_stops = [], []
    for k in range(0, len(steps), group):
        done = many.process_steps(steps[k:k + group])
        together += done.deltas
        together_stops += done.stops
    want, got = by_request(alone), by_request(together)
    assert got == want
    assert want["stops"][1].endswith("café — and ") and want["stops"][3] == "stop"
    assert want["plain"][1] == tok.decode(tok.encode(TEXT, add_special_tokens=False),
                                          skip_special_tokens=True)
    assert together_stops == alone_stops == [("stops", 0, "the end")]
    assert not one.live and not many.live


@pytest.mark.timeout(60)
def test_a_joined_output_keeps_every_steps_logprobs(tok):
    params = {"lp": SamplingParams(max_tokens=100, logprobs=1)}
    op = processor(tok, params)
    outs = [[CoreOutput("lp", 0, [t], [-0.5 * t], [{t: -0.5 * t}], None, None, 3, k + 1, -1.0)]
            for k, t in enumerate([300, 301, 302])]
    (d,) = op.process_steps(outs).deltas
    assert d.new_token_ids == [300, 301, 302]
    assert d.token_logprobs == [-150.0, -150.5, -151.0]
    assert d.logprobs == [{300: -150.0}, {301: -150.5}, {302: -151.0}]
    assert d.num_output_tokens == 3 and not d.finished
