"""Errors the engine raises for bad input or impossible requests.

They subclass ``ValueError`` so callers that only know "bad input" can still catch them, while the
worker can map each to a protocol error code without parsing messages.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request itself is malformed (empty prompt, token id outside the vocabulary, ...)."""

    code = "invalid_request"


class PromptTooLongError(InvalidRequestError):
    """The request can never fit: prompt plus max_tokens beyond max_model_len, or the KV pool."""

    code = "prompt_too_long"


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture, rope type or dtype is not one the engine implements."""

    code = "unsupported_model"
