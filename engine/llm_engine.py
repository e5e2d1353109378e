"""LLMEngine: the step API (add_request / step / abort_request) the worker drives, with the
engine core in this process.

One ``step()`` = the core's step (admit requests whose grammar is ready -> schedule -> one
forward pass -> mask and sample -> finish rules, in token ids: engine/core.py) -> the output
processor's (text deltas, stop strings: engine/output_processor.py). The caller decides when
to step. See docs/contracts.md for the contract this implements, and engine/core_client.py
for the same front end around a core in its own process.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Optional, Sequence as Seq, Union

from tokenrelay.engine.config import EngineConfig
from tokenrelay.engine.core import EngineCore
from tokenrelay.engine.errors import InvalidRequestError
from tokenrelay.engine.output_processor import OutputProcessor
from tokenrelay.engine.outputs import RequestDelta, ResumeState
from tokenrelay.engine.prompts import (PromptType, check_chat_template_kwargs, prompt_of,
                                       render_chat, tool_call_format)
from tokenrelay.engine.request_checks import RequestChecks
from tokenrelay.engine.sampling_params import SamplingParams
from tokenrelay.protocol.tools import NO_TOOLS

__all__ = ["LLMEngine", "PromptType", "check_chat_template_kwargs", "prompt_of"]


class LLMEngine:
    """The engine in one process: the front end (request checks, tokenization, the output
    processor) around an ``EngineCore``. engine/core_client.py is the same front end around
    a core in a process of its own.

    ``model``/``tokenizer`` may be injected (tests use a fake model); by default they are
    loaded from ``config.model`` with ``engine.loader``. ``on_parallel_failure(message)`` is
    called once if a rank of a tensor-parallel engine dies or a collective fails (after which
    every step raises ``TensorParallelError``); the worker exits there.
    """

    def __init__(self, config: EngineConfig, *, model: Optional[Any] = None,
                 tokenizer: Optional[Any] = None,
                 on_parallel_failure: Optional[Callable[[str], None]] = None) -> None:
        config.resolve()        # a missing or unsupported checkpoint says so before its tokenizer
        if tokenizer is None:
            from tokenrelay.engine.loader import load_tokenizer
            tokenizer = load_tokenizer(config.model)
        self.tokenizer = tokenizer
        self.core = EngineCore(config, tokenizer=tokenizer, model=model,
                               on_parallel_failure=on_parallel_failure)
        self.config = self.core.config
        self.checks = RequestChecks(config=self.config, tokenizer=tokenizer,
                                    vocab_size=self.core.vocab_size,
                                    pool=self.core.block_manager.shape)
        self.outputs = OutputProcessor(tokenizer)
        self._prompts: dict[str, tuple[Optional[str], list[int], float]] = {}
        self._tool_format: Optional[str] = None

    # What tests and benchmarks read of the core, under the names they always had.
    vocab_size = property(lambda self: self.core.vocab_size)
    max_model_len = property(lambda self: self.core.max_model_len)
    eos_token_ids = property(lambda self: self.core.eos_token_ids)
    model_runner = property(lambda self: self.core.model_runner)
    block_manager = property(lambda self: self.core.block_manager)
    scheduler = property(lambda self: self.core.scheduler)
    sampler = property(lambda self: self.core.sampler)
    structured = property(lambda self: self.core.structured)
    overlap = property(lambda self: self.core.overlap)
    counters = property(lambda self: self.core.counters)
    requests = property(lambda self: self.core.requests)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "LLMEngine":
        model = kwargs.pop("model_object", None)
        tokenizer = kwargs.pop("tokenizer_object", None)
        return cls(EngineConfig(**kwargs), model=model, tokenizer=tokenizer)

    # -- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType,
                    params: Union[SamplingParams, Mapping[str, Any], None] = None,
                    priority: int = 0,
                    resume: Union[ResumeState, Seq[ResumeState], None] = None,
                    owner: Optional[str] = None) -> None:
        """Queue a request. Raises InvalidRequestError / PromptTooLongError (with the numbers)
        or pydantic's ValidationError for bad sampling fields; on error nothing is changed.

        ``resume``: for ``n == 1`` a ResumeState; for ``n > 1`` one per choice (a choice with
        ``finish_reason`` set already ended and is not run). Beam search is never resumed.

        A request with ``structured_outputs`` waits outside the scheduler until its grammar is
        compiled (engine/structured.py); a spec known to fail raises GrammarError here."""
        if self.outputs.has(request_id) or request_id in self.core.requests:
            raise InvalidRequestError(f"request_id: {request_id!r} is already in use")
        req, text = self.checks.build(request_id, prompt, params, priority, resume)
        req.owner = owner       # the job's producer: its grammar compile's turn (compile_queue)
        self.core.add(req)
        self.outputs.add(request_id, req.prompt_token_ids, req.params, req.resume)
        self._prompts[request_id] = (text, req.prompt_token_ids, time.time())

    def abort_request(self, request_id: str) -> bool:
        """Drop a request in any state and free its blocks at once. Silent: no delta follows."""
        self.outputs.abort(request_id)
        self._prompts.pop(request_id, None)
        return self.core.abort(request_id)

    def request_prompt(self, request_id: str) -> tuple[Optional[str], list[int], float]:
        """A live request's prompt text (None when it came as ids), its ids and when it was
        added (``LLM.generate`` reads them for its outputs)."""
        return self._prompts[request_id]

    def request_seed(self, request_id: str) -> int:
        """The sampling seed of a live request (drawn at add time when it gave none)."""
        return self.core.request_seed(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished()

    def num_unfinished_requests(self) -> int:
        return len(self.core.requests)

    def free_capacity(self) -> int:
        """How many more requests could start soon (see Scheduler.free_capacity)."""
        return self.core.free_capacity()

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Run one scheduling step; return at most one delta per choice that got a token
        (and the error delta of each request the engine ended: see RequestDelta.error).
        A stop string found in this step's text ends its choice in the core at once."""
        done = self.outputs.process(self.core.step())
        for request_id, index, stop in done.stops:
            self.core.finish_choice(request_id, index, stop)
        for request_id in done.ended:
            self._prompts.pop(request_id, None)
        return done.deltas

    def shutdown(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (also done when it is garbage
        collected or the process exits); nothing to do at size 1. Stops the overlapped core's
        device thread (CPU) after its step in flight."""
        self.core.shutdown()

    # -- statistics ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters for metrics and benches; the queue and KV figures are the scheduler's."""
        return self.core.stats()

    # -- chat ------------------------------------------------------------------------------
    def render_chat(self, messages: list[dict],
                    chat_template_kwargs: Optional[Mapping[str, Any]] = None,
                    tools: Optional[list[dict]] = None) -> str:
        """The checkpoint's chat template applied, with the generation prompt.
        ``chat_template_kwargs`` are variables the template reads (Qwen3's
        ``enable_thinking``), as vLLM and its OpenAI server take them; ``tools`` are OpenAI's
        function tools, refused when the template does not render them."""
        return render_chat(self.tokenizer, messages, chat_template_kwargs, tools,
                           self.tool_call_format if tools else NO_TOOLS)

    @property
    def tool_call_format(self) -> str:
        """What the chat template does with tools (``engine.prompts.tool_call_format``),
        found once; the worker advertises it in its heartbeat."""
        if self._tool_format is None:
            self._tool_format = tool_call_format(self.tokenizer)
        return self._tool_format
