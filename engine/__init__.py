"""tokenrelay's inference engine: paged KV cache, continuous batching, vLLM-shaped API.

    from tokenrelay.engine import LLM, SamplingParams, BeamSearchParams

``SamplingParams`` (and ``StructuredOutputsParams``) is the job contract's own schema
(``protocol.sampling_params``), re-exported so engine users import it from here as vLLM users
do. Heavy names (``LLM``, ``LLMEngine``, ``BeamSearchParams``, ...) are imported lazily: importing
``engine`` for its params or errors loads no torch.
"""

from __future__ import annotations

if not __name__.startswith("tokenrelay."):   # the bare folder, imported from the repository root
    raise ImportError(f"import tokenrelay.{__name__} (commands: `tokenrelay ...`), not {__name__!r}: "
                      "our packages live under the tokenrelay namespace")

from tokenrelay._lazy import lazy_exports
from tokenrelay.engine.errors import InvalidRequestError, PromptTooLongError, UnsupportedModelError
from tokenrelay.engine.sampling_params import SamplingParams, StructuredOutputsParams

_LAZY = {
    "LLM": "tokenrelay.engine.llm",
    "BeamSearchParams": "tokenrelay.engine.beam_search",
    "LLMEngine": "tokenrelay.engine.llm_engine",
    "EngineConfig": "tokenrelay.engine.config",
    "RequestOutput": "tokenrelay.engine.outputs",
    "CompletionOutput": "tokenrelay.engine.outputs",
    "RequestDelta": "tokenrelay.engine.outputs",
    "ResumeState": "tokenrelay.engine.outputs",
    "TextPrompt": "tokenrelay.engine.prompts",
    "TokensPrompt": "tokenrelay.engine.prompts",
}

__all__ = ["SamplingParams", "StructuredOutputsParams", "InvalidRequestError", "PromptTooLongError",
           "UnsupportedModelError", *_LAZY]

__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
