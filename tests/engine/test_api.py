"""The public surface: LLM.generate/chat/stats and the LLMEngine step API, including bad input."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from tokenrelay.engine import LLM, InvalidRequestError, PromptTooLongError, SamplingParams
from tokenrelay.engine.llm_engine import LLMEngine


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def path(tiny_checkpoint):
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, num_kv_blocks=256, max_model_len=512)


@pytest.fixture()
def engine(path):
    return LLMEngine.from_kwargs(model=path, num_kv_blocks=64, max_model_len=512)


def drain(engine: LLMEngine) -> dict:
    out: dict = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            out.setdefault(d.request_id, []).append(d)
    return out


def test_generate_returns_outputs_in_input_order_with_metrics(llm):
    prompts = ["first prompt", [1, 40, 41, 42], "a third, longer prompt " * 3]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 5, 7)]
    outs = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5, 7]
    assert outs[0].prompt == "first prompt" and outs[1].prompt_token_ids == [1, 40, 41, 42]
    for o in outs:
        m = o.metrics
        assert m.arrival_time <= m.first_token_time <= m.finished_time
        assert o.outputs[0].finish_reason == "length" and o.finished
        assert o.outputs[0].text == llm.get_tokenizer().decode(o.outputs[0].token_ids,
                                                               skip_special_tokens=True)
    single = llm.generate("first prompt", params[0])
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_stats_keys(llm):
    llm.generate(["hello there"], SamplingParams(max_tokens=4))
    s = llm.stats()
    for key in ("num_preemptions", "kv_blocks_total", "kv_blocks_used", "kv_utilization_peak",
                "prefix_cache_hit_rate", "num_running", "num_waiting"):
        assert key in s
    assert s["kv_blocks_total"] == 256 and s["kv_blocks_used"] == 0
    assert 0 < s["kv_utilization_peak"] <= 1


def test_chat_uses_the_template(llm):
    msgs = [{"role": "user", "content": "Hi!"}]
    rendered = llm.engine.render_chat(msgs)
    assert rendered.endswith("<|im_start|>assistant\n") and "Hi!" in rendered
    outs = llm.chat([msgs, msgs + [{"role": "assistant", "content": "Yo"}]],
                    SamplingParams(max_tokens=3, temperature=0))
    assert len(outs) == 2 and outs[0].prompt == rendered
    assert llm.chat(msgs, SamplingParams(max_tokens=3, temperature=0))[0].outputs[0].token_ids \
        == outs[0].outputs[0].token_ids


@pytest.mark.parametrize("prompt, field", [
    ("", "prompt"), ([], "prompt"), ([1, 10**6], "prompt"), ([1, -1], "prompt"),
    ("ok", "request_id"),
])
def test_bad_prompt_or_id_is_refused(engine, prompt, field):
    engine.add_request("dup", "hello", SamplingParams(max_tokens=2))
    rid = "dup" if field == "request_id" else "new"
    with pytest.raises(InvalidRequestError, match=field):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=2))
    assert list(engine.requests) == ["dup"]
    assert drain(engine)["dup"][-1].finished     # the engine still serves the good one


@pytest.mark.parametrize("fields, name", [
    ({"temperature": float("nan")}, "temperature"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_token": 3}, "max_token"),
])
def test_bad_sampling_fields_name_the_field(engine, fields, name):
    with pytest.raises(ValidationError, match=name):
        engine.add_request("x", "hello", fields)
    with pytest.raises(ValueError, match=name):
        SamplingParams(**fields)
    assert not engine.has_unfinished_requests()


def test_too_long_requests_are_refused_with_numbers(path):
    engine = LLMEngine.from_kwargs(model=path, num_kv_blocks=4, block_size=16, max_model_len=512)
    with pytest.raises(PromptTooLongError, match=r"500.*20.*520.*512"):
        engine.add_request("a", [5] * 500, SamplingParams(max_tokens=20))
    with pytest.raises(PromptTooLongError, match=r"needs 5 KV blocks.*pool has 4"):
        engine.add_request("b", [5] * 60, SamplingParams(max_tokens=10))
    engine.add_request("c", [5] * 60, SamplingParams(max_tokens=5))   # 64 tokens: 4 blocks
    assert drain(engine)["c"][-1].finish_reason == "length"


def test_abort_frees_at_once_and_is_silent(engine):
    engine.add_request("a", "a long enough prompt to hold a few blocks " * 4,
                       SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", "another", SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort_request("a") is True
    assert engine.abort_request("a") is False and engine.abort_request("nope") is False
    out = drain(engine)
    assert "a" not in out and out["b"][-1].finished
    assert engine.block_manager.num_used_blocks == 0


def test_stop_token_ids_eos_and_min_tokens(engine):
    tok = engine.tokenizer
    engine.add_request("free", "Tell me", SamplingParams(max_tokens=12, temperature=0,
                                                           ignore_eos=True))
    first = [t for d in drain(engine)["free"] for t in d.new_token_ids]
    stop_at = first[3]
    engine.add_request("s", "Tell me", SamplingParams(max_tokens=12, temperature=0,
                                                        stop_token_ids=[stop_at], ignore_eos=True))
    ds = drain(engine)["s"]
    assert ds[-1].finish_reason == "stop" and ds[-1].stop_reason == stop_at
    assert [t for d in ds for t in d.new_token_ids] == first[:first.index(stop_at) + 1]
    engine.add_request("m", "Tell me", SamplingParams(max_tokens=12, temperature=0,
                                                        min_tokens=12, stop_token_ids=[stop_at],
                                                        ignore_eos=True))
    assert len(drain(engine)["m"]) == 12
    assert 2 in engine.eos_token_ids and 4 in engine.eos_token_ids   # </s> and <|im_end|>
    assert tok.eos_token_id in engine.eos_token_ids


def test_stop_string_trims_text(engine):
    engine.add_request("free", "Story:", SamplingParams(max_tokens=20, temperature=0,
                                                          ignore_eos=True))
    text = "".join(d.new_text for d in drain(engine)["free"])
    stop = text[5:8]
    engine.add_request("s", "Story:", SamplingParams(max_tokens=20, temperature=0,
                                                       ignore_eos=True, stop=[stop]))
    ds = drain(engine)["s"]
    assert "".join(d.new_text for d in ds) == text[:text.index(stop)]
    assert ds[-1].finish_reason == "stop" and ds[-1].stop_reason == stop


def test_deltas_carry_counts_and_logprobs(engine):
    engine.add_request("a", [1, 50, 60, 70], SamplingParams(max_tokens=4, logprobs=3,
                                                             temperature=0.8, seed=1))
    ds = drain(engine)["a"]
    assert [d.num_output_tokens for d in ds] == [1, 2, 3, 4]
    assert all(d.num_prompt_tokens == 4 for d in ds)
    for d in ds:
        (tok,) = d.new_token_ids
        assert tok in d.logprobs[0] and len(d.logprobs[0]) >= 3
        assert math.isclose(d.logprobs[0][tok], d.token_logprobs[0], abs_tol=1e-6)


def test_request_seed_drawn_and_free_capacity(engine):
    engine.add_request("a", "hi", SamplingParams(max_tokens=2))
    engine.add_request("b", "hi", SamplingParams(max_tokens=2, seed=42))
    assert isinstance(engine.request_seed("a"), int) and engine.request_seed("b") == 42
    with pytest.raises(KeyError):
        engine.request_seed("zzz")
    cap = engine.free_capacity()
    assert 0 <= cap <= engine.config.max_num_seqs - 2
    drain(engine)
    assert engine.free_capacity() >= cap
    assert engine.num_unfinished_requests() == 0


def test_generate_with_one_bad_prompt_queues_nothing(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


def test_vllm_prompt_dicts_are_prompts_not_lists_of_keys(llm):
    """#18: a dict used to be iterated, generating from the text "prompt"."""
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    text, ids = "a dict prompt", [1, 40, 41, 42]
    plain = llm.generate([text, ids], greedy)
    from tokenrelay.engine import TextPrompt, TokensPrompt
    as_dicts = llm.generate([TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=ids)], greedy)
    assert [o.outputs[0].token_ids for o in as_dicts] == [o.outputs[0].token_ids for o in plain]
    assert as_dicts[0].prompt == text and as_dicts[1].prompt_token_ids == ids
    (single,) = llm.generate({"prompt": text}, greedy)
    assert single.outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.generate({"prompt": "prompt"}, greedy)[0].prompt == "prompt"


@pytest.mark.parametrize("bad, words", [
    ({"text": "hi"}, "unsupported prompt dict keys ['text']"),
    ({"prompt": "hi", "prompt_token_ids": [1, 2]}, "exactly one of"),
    ({}, "exactly one of"),
    ({"prompt": ["hi"]}, "'prompt' must be a string"),
    ({"prompt_token_ids": "1 2 3"}, "'prompt_token_ids' must be a list"),
    ({"prompt": "hi", "multi_modal_data": {}}, "multi_modal_data"),
    (42, "got int"),
    ({"a", "b"}, "got set"),
])
def test_anything_else_is_refused_with_the_reason(llm, bad, words):
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(bad, SamplingParams(max_tokens=2))
    assert words in str(err.value)
    assert not llm.engine.has_unfinished_requests()


def test_engine_add_request_takes_prompt_dicts(engine):
    engine.add_request("d1", {"prompt_token_ids": [1, 40, 41]},
                       SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request("d2", {"prompt": "hello"}, SamplingParams(max_tokens=2, ignore_eos=True))
    out = drain(engine)
    assert out["d1"][0].num_prompt_tokens == 3
    assert sum(len(d.new_token_ids) for d in out["d2"]) == 2


def test_chat_template_kwargs_reach_the_template(llm):
    """#18: Qwen3-style template options (``enable_thinking``) could not be given."""
    tok = llm.get_tokenizer()
    saved = tok.chat_template
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if enable_thinking is defined and not enable_thinking %}"
                         "<no_think>{% endif %}<assistant>")
    try:
        msgs = [{"role": "user", "content": "Hi!"}]
        assert llm.engine.render_chat(msgs) == "<user>Hi!<assistant>"
        off = {"enable_thinking": False}
        assert llm.engine.render_chat(msgs, off) == "<user>Hi!<no_think><assistant>"
        (out,) = llm.chat(msgs, SamplingParams(max_tokens=2), chat_template_kwargs=off)
        assert out.prompt == "<user>Hi!<no_think><assistant>"
        for bad in ({"add_generation_prompt": False}, {"tokenize": True}, {1: "x"}, ["x"]):
            with pytest.raises(InvalidRequestError, match="chat_template_kwargs"):
                llm.engine.render_chat(msgs, bad)
    finally:
        tok.chat_template = saved
