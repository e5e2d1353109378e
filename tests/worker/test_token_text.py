"""worker/token_text.py: the text and raw bytes of single tokens that logprobs report."""

from __future__ import annotations

import pytest

from tokenrelay.worker.fake_engine import FakeTokenizer
from tokenrelay.worker.token_text import TokenTexts, byte_decoder, piece_bytes


def test_byte_alphabet_is_gpt2s():
    table = byte_decoder()
    assert len(table) == 256 and sorted(table.values()) == list(range(256))
    assert table["Ġ"] == 32 and table["a"] == 97 and table["Ã"] == 0xC3


def test_pieces_to_bytes():
    assert piece_bytes("Ġhello", " hello") == b" hello"
    assert piece_bytes("Ã", "\ufffd") == b"\xc3"               # half of a UTF-8 character
    assert piece_bytes("<0xE2>", "\ufffd") == b"\xe2"            # SentencePiece byte fallback
    assert piece_bytes("▁hello", "hello") is None                 # not byte-level: use the text
    assert piece_bytes("Ġhello", "something else") is None       # never bytes of another text
    assert piece_bytes(None, "x") is None


def test_real_byte_level_tokenizer_gives_raw_bytes_of_partial_characters(tiny_checkpoint):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tiny_checkpoint("llama")))
    texts = TokenTexts(tok)
    partial = tok.convert_tokens_to_ids("Ã")         # the byte 0xC3 alone (é is C3 A9)
    text, raw = texts.get(partial)
    assert text == tok.decode([partial], skip_special_tokens=False) == "\ufffd"
    assert raw == b"\xc3"
    for tid in tok.encode(" hello world, é!", add_special_tokens=False):
        text, raw = texts.get(tid)
        assert text == tok.decode([tid], skip_special_tokens=False)
        assert raw.decode("utf-8", "replace") == text
    bos = tok.bos_token_id
    assert texts.get(bos) == (tok.bos_token, tok.bos_token.encode())
    assert texts.for_logprobs([{partial: -1.0, bos: -2.0}]) == {
        partial: ("\ufffd", b"\xc3"), bos: (tok.bos_token, tok.bos_token.encode())}


def test_fake_tokenizer_names_its_characters():
    texts = TokenTexts(FakeTokenizer())
    assert texts.get(97) == ("a", b"a")
    assert texts.get(0) == ("</s>", b"</s>")
    calls = []
    texts.tokenizer = type("Counting", (), {"decode": lambda self, ids, **kw: calls.append(ids)
                                            or "x"})()
    assert texts.get(97) == ("a", b"a") and not calls          # decoded once per id


@pytest.mark.parametrize("top", [0, 1, 3])
def test_fake_engine_logprobs_are_top_n_with_the_chosen_first(top):
    from tokenrelay.worker.fake_engine import fake_logprobs
    lp = fake_logprobs(ord("y"), top)
    assert list(lp)[0] == ord("y") and lp[ord("y")] == max(lp.values())
    assert len(lp) == max(1, top) and list(lp)[1:] == [ord("z"), ord("a")][:max(0, top - 1)]
