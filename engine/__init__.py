"""tokenrelay's inference engine: paged KV cache, continuous batching, vLLM-shaped API.

    from engine import LLM, SamplingParams, BeamSearchParams

``SamplingParams`` (and ``StructuredOutputsParams``) is the job contract's own schema
(``protocol.sampling_params``), re-exported so engine users import it from here as vLLM users
do. Heavy names (``LLM``, ``LLMEngine``, ``BeamSearchParams``, ...) are imported lazily: importing
``engine`` for its params or errors loads no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from engine.errors import InvalidRequestError, PromptTooLongError, UnsupportedModelError
from engine.sampling_params import SamplingParams, StructuredOutputsParams

_LAZY = {
    "LLM": "engine.llm",
    "BeamSearchParams": "engine.beam_search",
    "LLMEngine": "engine.llm_engine",
    "EngineConfig": "engine.config",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "RequestDelta": "engine.outputs",
    "ResumeState": "engine.outputs",
    "TextPrompt": "engine.prompts",
    "TokensPrompt": "engine.prompts",
}

__all__ = ["SamplingParams", "StructuredOutputsParams", "InvalidRequestError", "PromptTooLongError",
           "UnsupportedModelError", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
