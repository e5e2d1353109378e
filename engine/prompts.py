"""What a request's prompt may be (vLLM's prompt types) and the chat template's variables: the
checks the step API and the offline ``LLM`` share."""

from __future__ import annotations

from typing import Any, Mapping, Optional, TypedDict, Union

from engine.errors import InvalidRequestError
from protocol.wire import RESERVED_CHAT_TEMPLATE_KWARGS


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
