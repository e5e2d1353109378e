"""protocol/regex_size.py and ``max_regex_expansion``: the static estimate tells an ambiguous
counted repetition (the lexer tracks every count it could be at) from an ordinary one, reads
the syntax constraints use, gives up (None) on what it does not read; the limit refuses
"up to 1,000 words" at submit in microseconds (issue #42), where the engine's lexer fails."""

from __future__ import annotations

import time

import pytest

from tokenrelay.producer_sdk import Client
from tokenrelay.producer_sdk.errors import InvalidRequest
from tokenrelay.protocol.errors import ProtocolError
from tokenrelay.protocol.limits import DEFAULT_LIMITS, Limits
from tokenrelay.protocol.regex_size import expansion
from tokenrelay.protocol.structured_outputs import JSON_WHITESPACE
from tokenrelay.protocol.wire import validate_job

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("pattern, size", [
    (r"(\w+\s?){1,1000}", 3 * 1000 * 1000),     # a word may go on or the next one start
    (r"(\w+\s){1,1000}", 3 * 1000),             # a word ends only at its space
    ("(x?){1,1000}", 1000 * 1000),              # a body that matches "": any count fits
    ("a{1000}{1000}", 1000 * 1000),
    ("(ab|c){1,1000}", 3 * 1000),
    (r"(?:[A-Z][a-z]+ ?){1,20}", 4 * 20),       # a capital starts the next word
    (r"[a-z]{2,6}-[0-9]{2,4}", 6 + 1 + 4),
    ("[^\"]{0,10000}", 10000),
    (r"(?i)hello\b", 5),
    (r"(?P<area>\d{3})-\d{4}", 3 + 1 + 4),
])
def test_sizes(pattern, size):
    assert expansion(pattern) == size


def test_what_the_engine_itself_uses_is_small():
    assert expansion(JSON_WHITESPACE) < 100


@pytest.mark.parametrize("pattern", ["(a", "a)", "(?=a)b", "[a-z", "a{2", "\\"])
def test_unread_syntax_gets_no_estimate(pattern):
    assert expansion(pattern) is None


def test_linear_time_and_no_recursion_on_deep_or_long_patterns():
    deep = "(" * 4000 + "a" + "){1000}" * 4000
    t0 = time.perf_counter()
    assert expansion(deep) == 10**15                  # capped, not a 12,000-digit integer
    assert expansion("[a-z]" * 1600) == 1600
    assert time.perf_counter() - t0 < 2


# -- the limit: max_regex_expansion, checked with the payload's other limits on both sides

WORDS_1000 = r"(\w+\s?){1,1000}"


def job_with(spec: dict) -> dict:
    return {"v": 1, "job_id": "j", "prompt": "x", "params": {"structured_outputs": spec}}


@pytest.mark.parametrize("spec, field", [
    ({"regex": WORDS_1000}, "params.structured_outputs.regex"),
    ({"json_object": True, "whitespace_pattern": r"( ?\s?){1,2000}"},
     "params.structured_outputs.whitespace_pattern"),
    ({"json": {"type": "object", "properties": {"bio": {"type": "string",
                                                         "pattern": f"^{WORDS_1000}$"}}}},
     "params.structured_outputs.json"),
])
def test_up_to_1000_words_is_refused_at_submit_by_its_size_alone(spec, field):
    t0 = time.perf_counter()
    with pytest.raises(ProtocolError, match="max_regex_expansion") as err:
        validate_job(job_with(spec))                  # the worker's decode runs this too
    assert err.value.field == field
    with pytest.raises(InvalidRequest, match=r"\\w\+\\s, not"):
        Client("redis://127.0.0.1:1").prepare("x", structured_outputs=spec)
    assert time.perf_counter() - t0 < 0.5             # no compile: the probe needed ~8 s


def test_what_fits_passes_and_the_limit_is_a_setting():
    validate_job(job_with({"regex": r"(\w+\s?){1,300}"}))
    validate_job(job_with({"regex": WORDS_1000}), Limits(max_regex_expansion=3_000_000))
    assert expansion(WORDS_1000) > DEFAULT_LIMITS.max_regex_expansion \
        > expansion(r"(\w+\s?){1,700}")


@pytest.mark.timeout(120)
def test_the_limit_sits_where_the_engines_lexer_gives_up():
    """Under the engine's parser limits, 1,000 words fail partway through an answer (so the
    refusal costs nobody a working constraint) and 300 run to their end."""
    assert lexer_fails_on_text(WORDS_1000)
    assert not lexer_fails_on_text(r"(\w+\s?){1,300}")


def lexer_fails_on_text(pattern: str) -> bool:
    import llguidance

    from tokenrelay.protocol.grammar_probe import probe_tokenizer
    from tokenrelay.protocol.structured_outputs import (StructuredOutputsParams, grammar_of,
                                                        parser_limits)
    grammar = grammar_of(StructuredOutputsParams.model_construct(regex=pattern).canonical)
    m = llguidance.LLMatcher(probe_tokenizer(), grammar, log_level=0, limits=parser_limits())
    for byte in b"the quick brown fox jumps over the lazy dog " * 60:
        m.compute_bitmask()
        if m.is_error() or not m.consume_token(byte):
            return True
        if m.is_stopped():
            return False
    return False
