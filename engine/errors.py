"""Errors the engine raises for bad input or impossible requests, and for a broken
tensor-parallel group.

The input errors subclass ``ValueError`` so callers that only know "bad input" can still catch
them, while the worker can map each to a protocol error code without parsing messages.
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


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel engine died, or a collective among its ranks failed or timed
    out. The ranks are out of step from then on: the engine is unusable and every later step
    raises this again (a worker exits; its jobs are reclaimed by other workers)."""

    code = "internal"
