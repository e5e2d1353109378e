"""What a request's prompt may be (vLLM's prompt types), the chat template's variables and
tools, and the rendering of a conversation: what the step API and the offline ``LLM`` share."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, TypedDict, Union

from tokenrelay.engine.errors import InvalidRequestError
from tokenrelay.protocol.tools import HERMES, NO_TOOLS, UNPARSED
from tokenrelay.protocol.wire import RESERVED_CHAT_TEMPLATE_KWARGS


class TextPrompt(TypedDict):
    """vLLM's text prompt dict."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's token-ids prompt dict."""

    prompt_token_ids: list[int]


# A prompt: text, token ids, or one of vLLM's prompt dicts.
PromptType = Union[str, list[int], TextPrompt, TokensPrompt]
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def check_chat_template_kwargs(kwargs: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """The template variables as a dict; InvalidRequestError for anything else."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidRequestError("chat_template_kwargs: must be a dict with string keys")
    reserved = sorted(RESERVED_CHAT_TEMPLATE_KWARGS & set(kwargs))
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs: {reserved} are set by the engine, "
                                  f"not by the request")
    return dict(kwargs)


def prompt_of(prompt: Any) -> Union[str, list[int]]:
    """The text or token ids a prompt holds; a prompt dict must hold exactly one of
    ``prompt`` / ``prompt_token_ids`` and nothing this engine would silently ignore."""
    if not isinstance(prompt, Mapping):
        return prompt
    unknown = sorted(str(k) for k in prompt if k not in _PROMPT_KEYS)
    if unknown:
        raise InvalidRequestError(
            f"prompt: unsupported prompt dict keys {unknown}; a prompt dict holds either "
            f"'prompt' (text) or 'prompt_token_ids' (token ids)")
    present = [k for k in _PROMPT_KEYS if k in prompt]
    if len(present) != 1:
        raise InvalidRequestError(
            "prompt: a prompt dict holds exactly one of 'prompt' (text) or 'prompt_token_ids' "
            f"(token ids), got {present or 'neither'}")
    value = prompt[present[0]]
    if present[0] == "prompt" and not isinstance(value, str):
        raise InvalidRequestError(f"prompt: 'prompt' must be a string, got "
                                  f"{type(value).__name__}")
    if present[0] == "prompt_token_ids" and not isinstance(value, (list, tuple)):
        raise InvalidRequestError(f"prompt: 'prompt_token_ids' must be a list of token ids, "
                                  f"got {type(value).__name__}")
    return value


# A function no real conversation names: rendered with it, a template that reads ``tools``
# shows its name somewhere in the prompt.
_PROBE_TOOL = {"type": "function", "function": {
    "name": "tokenrelay_probe_function", "description": "probe",
    "parameters": {"type": "object", "properties": {}}}}


def tool_call_format(tokenizer: Any) -> str:
    """What the tokenizer's chat template does with ``tools`` (protocol/tools.py): ``hermes``
    when it renders them and asks for ``<tool_call>`` JSON calls (Qwen2/2.5/3, Hermes and
    others in that family), ``unparsed`` when it renders them in another call format,
    ``none`` when it ignores them (or has no template). Found by rendering a probe tool, as
    transformers' ``apply_chat_template(tools=...)`` would render a real one."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return NO_TOOLS
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                             tools=[_PROBE_TOOL], tokenize=False,
                                             add_generation_prompt=True)
    except Exception:  # a template that breaks on tools does not support them
        return NO_TOOLS
    if not isinstance(text, str) or _PROBE_TOOL["function"]["name"] not in text:
        return NO_TOOLS
    source = template if isinstance(template, str) else " ".join(map(str, template.values()))
    return HERMES if "<tool_call>" in source else UNPARSED


def check_tools(tools: Optional[Sequence[Mapping[str, Any]]], tool_format: str) -> list[dict]:
    """The tools as a list of dicts for the template; InvalidRequestError when the template
    would silently drop them (``tool_format`` ``none``), since the model would never see
    them."""
    if not tools:
        return []
    if tool_format == NO_TOOLS:
        raise InvalidRequestError(
            "tools: this model's chat template does not render tools (tool_format none), so "
            "the model would never see them; leave them out (a params.structured_outputs "
            "constraint can still force a call's JSON) or serve a model whose template "
            "supports tools")
    if not all(isinstance(t, Mapping) for t in tools):
        raise InvalidRequestError("tools: must be a list of {'type': 'function', 'function': "
                                  "{...}} dicts")
    return [dict(t) for t in tools]


def render_chat(tokenizer: Any, messages: Any, chat_template_kwargs: Optional[Mapping[str, Any]],
                tools: Optional[Sequence[Mapping[str, Any]]], tool_format: str) -> str:
    """The checkpoint's chat template applied, with the generation prompt. ``tools`` go to
    the template as transformers' ``apply_chat_template(tools=...)`` gives them."""
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise InvalidRequestError("messages: must be a list of {'role', 'content'} dicts")
    for m in messages:
        if "role" not in m or "content" not in m:
            raise InvalidRequestError("messages: every message needs 'role' and 'content'")
    kwargs = check_chat_template_kwargs(chat_template_kwargs)
    tool_list = check_tools(tools, tool_format)
    if tool_list:
        kwargs["tools"] = tool_list
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=True, **kwargs)
    # No template in the checkpoint: a plain, readable fallback.
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + "assistant:"
