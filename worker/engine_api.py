"""The engine contract the worker drives (docs/contracts.md, "Engine step API"), and
``load_engine``, which builds the engine ``--model`` names.

Both ``engine.llm_engine.LLMEngine`` and ``worker.fake_engine.FakeEngine`` (``--model fake:``)
satisfy ``EngineAPI``; tests/worker/test_engine_api.py runs one contract test against both.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol, Sequence, Union, runtime_checkable

from tokenrelay.engine.outputs import RequestDelta, ResumeState
from tokenrelay.engine.sampling_params import SamplingParams
from tokenrelay.protocol.tools import HERMES, TOOL_FORMATS
from tokenrelay.worker.config import WorkerSettings

__all__ = ["EngineAPI", "Tokenizer", "RequestDelta", "ResumeState", "load_engine"]


@runtime_checkable
class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@runtime_checkable
class EngineAPI(Protocol):
    """What the worker calls, and nothing more.

    ``add_request`` raises ``engine.errors.PromptTooLongError`` / ``InvalidRequestError`` for a
    request it refuses (the worker ends that job alone; any other exception is treated the same
    way, as ``internal``); ``owner`` is the job's producer, among whom the engine shares its
    grammar compiles fairly; ``step`` runs one scheduling step and returns at most one delta per
    running request; an exception from ``step`` means the engine may be unusable (the worker
    hands its jobs back and exits 1). ``request_ids`` on that exception, when present, names
    the requests that caused it.
    """

    tokenizer: Tokenizer
    max_model_len: int          # prompt + output tokens: a chat job without max_tokens fills it
    tool_call_format: str       # what the chat template does with tools (protocol/tools.py)

    def add_request(self, request_id: str, prompt: Union[str, list[int]],
                    params: SamplingParams, priority: int = 0,
                    resume: Optional[ResumeState] = None,
                    owner: Optional[str] = None) -> None: ...

    def abort_request(self, request_id: str) -> bool: ...

    def step(self) -> Sequence[RequestDelta]: ...

    def has_unfinished_requests(self) -> bool: ...

    def free_capacity(self) -> int: ...

    def render_chat(self, messages: list[dict],
                    chat_template_kwargs: Optional[Mapping[str, Any]] = None,
                    tools: Optional[list[dict]] = None) -> str: ...

    def stats(self) -> Mapping[str, Any]: ...


_SUMMARY_FIELDS = ("dtype", "device", "max_num_seqs", "max_num_batched_tokens", "block_size",
                   "max_model_len", "enable_prefix_caching", "attention_backend",
                   "enforce_eager", "tensor_parallel_size")


def describe_engine(engine: EngineAPI) -> dict[str, Any]:
    """The engine's configuration in one log line at start-up: the resolved settings (an
    engine with a ``config``, as LLMEngine has) and the size of its KV pool."""
    config = getattr(engine, "config", None)
    out = {name: str(getattr(config, name)) for name in _SUMMARY_FIELDS
           if config is not None and hasattr(config, name)}
    stats = engine.stats()
    out["kv_blocks"] = stats.get("kv_blocks_total")
    out["engine"] = type(engine).__name__
    return out


def load_engine(settings: WorkerSettings) -> EngineAPI:
    """Build the engine named by ``--model``; ``fake:k=v,...`` builds the FakeEngine (producers
    test their code with it, no model needed): max_num_seqs, step_delay, max_model_len, and
    tools (the tool_format its "template" advertises: hermes, unparsed or none)."""
    if not settings.model:
        raise ValueError("--model (or TOKENRELAY_MODEL) is required")
    if settings.model.startswith("fake:"):
        from tokenrelay.worker.fake_engine import FakeEngine  # no torch: a fake worker starts in a second
        kw = dict(p.split("=", 1) for p in settings.model[5:].split(",") if p)
        return FakeEngine(max_num_seqs=int(kw.get("max_num_seqs", settings.max_num_seqs or 8)),
                          step_delay=float(kw.get("step_delay", 0.0)),
                          max_model_len=int(kw.get("max_model_len", settings.max_model_len or 4096)),
                          max_n=settings.max_n, max_beam_width=settings.max_beam_width,
                          tool_format=_tool_format(kw.get("tools", HERMES)))
    from tokenrelay.engine.config import EngineConfig
    worker_id = settings.resolved_worker_id()
    config = EngineConfig(**settings.engine_kwargs())
    if wants_core_process(settings):
        from tokenrelay.engine.core_client import EngineCoreClient
        return EngineCoreClient(config, timeout_s=settings.engine_core_timeout(),
                                on_failure=lambda message: exit_on_engine_failure(
                                    message, worker_id, "engine core process"))
    from tokenrelay.engine.llm_engine import LLMEngine
    return LLMEngine(config, on_parallel_failure=lambda message: exit_on_engine_failure(
        message, worker_id, "tensor-parallel engine"))


def wants_core_process(settings: WorkerSettings) -> bool:
    """``--engine-process`` of these settings, resolved (``core_process_on``)."""
    return core_process_on(settings.engine_process, settings.device)


def core_process_on(choice: str, device: Optional[str]) -> bool:
    """``--engine-process`` resolved: auto is on beside a GPU (the step's Python and the
    worker's must not share a GIL there) and off on a CPU, where the step's kernels hold the
    cores and a second process only competes for them (docs/architecture.md has the
    figures). ``device`` None: CUDA when torch sees one. The worker and benchmarks.worker
    (whose in-process baseline must run the same kind of engine) both resolve it here."""
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"--engine-process {choice!r}: expected auto, on or off")
    if choice != "auto":
        return choice == "on"
    if device is None:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device.startswith("cuda")


def openmp_defaults() -> dict[str, str]:
    """The OpenMP settings a worker's engine runs under unless the environment sets them
    (read when torch loads its OpenMP runtime; an engine core's process inherits them).
    OpenMP threads that spin long after each parallel region starve the Redis flush, the
    server and readers on small CPU hosts (p99 token delivery 10 ms -> 5 ms on 2 cores);
    threads that sleep at once pay a wake-up at every barrier of the compiled CPU kernels
    (throughput through Redis fell to 0.86 of in-process). GNU OpenMP's short spin before
    sleeping (20,000 iterations, ~0.2 ms) keeps both: 0.94-0.96 of in-process, p99 1.7-3 ms
    (benchmarks.worker, 2 cores)."""
    return {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "20000"}


def exit_on_engine_failure(message: str, worker_id: str, what: str) -> None:
    """A tensor-parallel rank or the engine core's process died (or a collective failed, or
    the core went silent): the engine cannot step again. The worker exits at once, as if it
    had been killed, with one log line saying why; its jobs' leases lapse and other workers
    reclaim and resume them exactly once (the same path as after a SIGKILL). Its child
    processes end with it (their lifelines close)."""
    import os
    import sys

    from tokenrelay.worker.logs import get_logger
    get_logger(worker_id=worker_id).error(
        f"{what} failed; worker exiting so other workers reclaim its jobs", cause=message,
        exit_code=EXIT_PARALLEL_FAILURE)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(EXIT_PARALLEL_FAILURE)


# The exit status after a tensor-parallel failure: the engine's, like an engine step failure.
EXIT_PARALLEL_FAILURE = 1


def _tool_format(value: str) -> str:
    if value not in TOOL_FORMATS:
        raise ValueError(f"--model fake:tools={value}: expected one of {', '.join(TOOL_FORMATS)}")
    return value
