"""Tools and the chat template (engine/prompts.py): what a template does with ``tools`` is
found by rendering a probe (``hermes`` for the tiny Hermes-style template, ``none`` for plain
ChatML and SmolLM2's), tools reach the template as transformers' ``apply_chat_template(tools=)``
gives them, with assistant tool calls and tool results, and a template that would drop them
refuses them instead of ignoring them silently."""

from __future__ import annotations

import pytest

from tokenrelay.engine.errors import InvalidRequestError
from tokenrelay.engine.prompts import render_chat, tool_call_format

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TURNS = [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": "Weather in Oslo?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"type": "function", "function": {"name": "get_weather",
                                               "arguments": {"city": "Oslo"}}}]},
         {"role": "tool", "content": "rain"}]


@pytest.fixture(scope="module")
def tokenizers(tiny_checkpoint):
    from tokenrelay.engine.loader import load_tokenizer
    return {"tools": load_tokenizer(tiny_checkpoint("qwen2", chat_template="tools")),
            "chatml": load_tokenizer(tiny_checkpoint("qwen2"))}


def test_the_tool_format_is_found_by_rendering_a_probe(tokenizers):
    from tests.fixtures_redis import REPO_ROOT
    assert tool_call_format(tokenizers["tools"]) == "hermes"
    assert tool_call_format(tokenizers["chatml"]) == "none"
    smol = REPO_ROOT / ".models" / "smollm2"
    if (smol / "tokenizer.json").is_file():
        from tokenrelay.engine.loader import load_tokenizer
        assert tool_call_format(load_tokenizer(smol)) == "none"


def test_tools_calls_and_results_are_rendered(tokenizers):
    tok = tokenizers["tools"]
    text = render_chat(tok, TURNS, None, TOOLS, "hermes")
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "get_weather"' in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' \
        in text
    assert "<tool_response>\nrain\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert "# Tools" not in render_chat(tok, TURNS[:2], None, None, "hermes")


def test_a_template_that_ignores_tools_refuses_them(tokenizers):
    with pytest.raises(InvalidRequestError, match="does not render tools"):
        render_chat(tokenizers["chatml"], TURNS[:2], None, TOOLS, "none")
    with pytest.raises(InvalidRequestError, match="set by the engine"):
        render_chat(tokenizers["tools"], TURNS[:2], {"tools": TOOLS}, None, "hermes")


@pytest.mark.timeout(120)
def test_llm_chat_takes_tools_as_vllm_does(tiny_checkpoint):
    from tokenrelay.engine import LLM, SamplingParams
    llm = LLM(str(tiny_checkpoint("qwen2", chat_template="tools")), num_kv_blocks=64,
              enforce_eager=True)
    assert llm.engine.tool_call_format == "hermes"
    params = SamplingParams(max_tokens=2, temperature=0)
    plain, with_tools = (llm.chat(TURNS[:2], params)[0],
                         llm.chat(TURNS[:2], params, tools=TOOLS)[0])
    assert "# Tools" in with_tools.prompt and "# Tools" not in plain.prompt
    assert len(with_tools.prompt_token_ids) > len(plain.prompt_token_ids)
