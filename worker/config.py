"""Worker settings: pydantic-settings models, filled from CLI flags over ``TOKENRELAY_<NAME>`` env
vars over defaults. The flags are generated from the fields by the one settings layer
(protocol/settings.py), shared with ``tokenrelay``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import re
import socket
from pathlib import Path
from typing import Any, Optional

from pydantic import ByteSize, Field, create_model, field_validator

from tokenrelay.protocol.settings import (CliSettings, ConnectionSettings, add_settings_flags,
                                          unset)
from tokenrelay.protocol.keys import Keys, PARKING_CONSUMER
from tokenrelay.protocol.limits import Limits
from tokenrelay.protocol.wire import MODEL_NAME_PATTERN

ENGINE_DEFAULT = unset("the engine's")


def limit_settings(base: type[CliSettings]) -> type[CliSettings]:
    """``base`` plus one setting per field of ``protocol.limits.Limits``, the limits' one
    declaration: the ``--max-*`` flags and ``TOKENRELAY_MAX_*`` variables take its names,
    bounds, defaults and descriptions, so the worker cannot restate (and drift from) them.
    A ``*_bytes`` limit is a ``ByteSize`` here, so a flag or variable may say ``4MiB``."""
    fields: dict[str, Any] = {
        name: (ByteSize if name.endswith("_bytes") else field.annotation, copy.copy(field))
        for name, field in Limits.model_fields.items()}
    return create_model(f"{base.__name__}Limits", __base__=base, __module__=__name__,
                        **fields)


class WorkerIdentity(ConnectionSettings):
    """Which worker's heartbeat: where (the connection), who (worker id, from the device when
    unset) and how often it beats. ``tokenrelay health`` needs exactly this."""

    worker_id: Optional[str] = Field(
        None, description="Consumer name; must be stable across restarts.",
        json_schema_extra=unset("<hostname>-<device>"))
    device: Optional[str] = Field(None, description="cuda, cuda:1, cpu.",
                                  json_schema_extra=unset("cuda when available, else cpu"))
    heartbeat_ms: int = Field(1000, ge=50, description="Heartbeat interval.")

    @field_validator("worker_id")
    @classmethod
    def _worker_id(cls, v: Optional[str]) -> Optional[str]:
        if v is None:
            return v
        if not re.match(r"^[A-Za-z0-9_.:@-]{1,200}$", v) or v == PARKING_CONSUMER:
            raise ValueError(f"worker_id must be 1-200 characters of [A-Za-z0-9_.:@-] and not "
                             f"{PARKING_CONSUMER!r}; got {v!r}")
        return v

    @property
    def keys(self) -> Keys:
        return Keys(self.namespace, self.queue)

    def resolved_worker_id(self) -> str:
        """The explicit id, else ``<hostname>-<device>``: stable across restarts of one slot."""
        return self.worker_id or default_worker_id(self.device)


class WorkerRun(WorkerIdentity):
    """What the worker runs and how: the model, the engine's options (``None``: the engine's
    default), the queue's timings. ``WorkerSettings`` adds the job limits and logging."""

    model: Optional[str] = Field(None, description="Hugging Face checkpoint folder to serve.",
                                 json_schema_extra=unset("none, required"))
    served_model_name: Optional[str] = Field(
        None, description="Model name this worker advertises in its heartbeat: what a request's "
        "model must say to be routed to its queue (and the metrics' model_name label).",
        json_schema_extra=unset("the checkpoint folder's name; fake for fake: engines"))
    generation_config: str = Field(
        "auto", description="Sampling defaults for what a job leaves unset (temperature, top_p, "
        "top_k, min_p, repetition_penalty, max_new_tokens as max_tokens): auto, the "
        "checkpoint's generation_config.json; vllm, none (the protocol's defaults); or a "
        "folder holding a generation_config.json (vLLM's --generation-config).")
    dtype: str = Field("auto", description="auto, float32, float16, bfloat16.")
    # None: the engine's default (EngineConfig), so the worker never restates it.
    max_num_seqs: Optional[int] = Field(None, ge=1, description="Max running sequences.",
                                        json_schema_extra=ENGINE_DEFAULT)
    max_num_batched_tokens: Optional[int] = Field(None, ge=1, description="Token budget per step.",
                                                  json_schema_extra=ENGINE_DEFAULT)
    block_size: Optional[int] = Field(None, ge=1, description="KV cache block size in tokens.",
                                      json_schema_extra=ENGINE_DEFAULT)
    kv_cache_memory_bytes: Optional[ByteSize] = Field(
        None, ge=1, description="KV pool size, e.g. 2GiB (overrides --gpu-memory-utilization).",
        json_schema_extra=unset("the engine's: on CPU 1GiB, on CUDA what "
                                "--gpu-memory-utilization leaves"))
    gpu_memory_utilization: Optional[float] = Field(
        None, gt=0, le=1, description="Fraction of the GPU's memory this worker may use for "
        "weights, activations and KV cache (vLLM's meaning; the KV pool gets what is left). "
        "Two workers on one card: 0.45 each. Ignored on CPU.",
        json_schema_extra=unset("the engine's (0.9)"))
    num_kv_blocks: Optional[int] = Field(None, ge=1, description="KV pool size in blocks "
                                         "(overrides --kv-cache-memory-bytes).",
                                         json_schema_extra=ENGINE_DEFAULT)
    max_model_len: Optional[int] = Field(None, ge=1, description="Max prompt+output tokens.",
                                         json_schema_extra=ENGINE_DEFAULT)
    enable_prefix_caching: Optional[bool] = Field(None, description="Reuse cached prompt prefixes.",
                                                  json_schema_extra=ENGINE_DEFAULT)
    attention_backend: Optional[str] = Field(None, description="torch, triton or auto.",
                                             json_schema_extra=ENGINE_DEFAULT)
    enforce_eager: Optional[bool] = Field(
        None, description="No CUDA graphs (GPU) and no compiled kernels (CPU float32): "
                          "seconds less start-up, slower steps.", json_schema_extra=ENGINE_DEFAULT)
    tensor_parallel_size: Optional[int] = Field(
        None, ge=1, description="Split the model over this many ranks: GPUs from --device on "
        "(cuda:0..N-1), or processes on CPU. Its query/KV heads and MLP size must divide by it "
        "(checked at start).", json_schema_extra=ENGINE_DEFAULT)
    tensor_parallel_timeout_s: Optional[float] = Field(
        None, gt=0, description="Seconds a tensor-parallel rank may wait in a collective before "
        "the engine gives up on its group and the worker exits (a frozen rank); start-up gets "
        "at least 120 s.", json_schema_extra=unset("half the lease (--lease-ms): the wait and the "
                                                    "exit fit within it"))
    async_scheduling: Optional[bool] = Field(
        None, description="Overlap the engine's steps: schedule and launch step N+1 before "
        "step N's results are processed (engine/overlap.py).",
        json_schema_extra=unset("the engine's: on for one CUDA device, off on CPU"))
    simulated_device_ms: Optional[float] = Field(
        None, ge=0, description="Serve a simulated device instead of the model's weights: "
        "each engine step's forward pass takes this many ms (the checkpoint's tokenizer and "
        "config are kept; the text means nothing). For measuring the serving stack around a "
        "GPU-like step on any machine (benchmarks/simulated_gpu.py).",
        json_schema_extra=unset("off: the model's weights"))
    engine_process: str = Field(
        "auto", pattern="^(auto|on|off)$",
        description="Run the engine core (schedule, run, sample) in a process of its own, so "
        "the worker's Python (detokenizing, building events, Redis writes) never holds the "
        "GIL the step needs: on, off, or auto (on beside a GPU, off for a CPU engine, whose "
        "step already holds the cores: docs/architecture.md).")
    engine_core_timeout_s: Optional[float] = Field(
        None, gt=0, description="Seconds the engine core's process may stay silent with work "
        "to do before the worker kills it and exits (a stopped or hung core).",
        json_schema_extra=unset("half the lease (--lease-ms)"))
    grammar_compile_threads: Optional[int] = Field(
        None, ge=1, description="Threads compiling structured-output grammars, off the step "
        "loop.", json_schema_extra=ENGINE_DEFAULT)
    grammar_compile_timeout_s: Optional[float] = Field(
        None, gt=0, description="Seconds a job's grammar may take to be ready (compile and "
        "wait) before the job ends with invalid_request.", json_schema_extra=ENGINE_DEFAULT)
    result_ttl: float = Field(3600.0, gt=0, description="Seconds a result stream lives after its "
                              "last write.")
    drain_timeout: float = Field(30.0, ge=0, description="Seconds running jobs get to finish on "
                                 "SIGTERM before they are handed back.")
    overlap_steps: Optional[bool] = Field(
        None, description="Build and write a step's token events while the engine computes the "
        "next step (one step in flight); off: one after the other. Unset: on, except for an "
        "engine on the CPU, whose step holds the cores (overlapping there only delays tokens).",
        json_schema_extra=unset("on, off for a CPU engine"))
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus port; 0 disables.")
    metrics_host: str = Field("0.0.0.0", description="Address the metrics server binds.")
    lease_ms: int = Field(30000, ge=100, description="Lease on held jobs; renewed every lease/3.")
    max_deliveries: int = Field(3, ge=1, description="Deliveries before a job is dead-lettered.")
    block_ms: int = Field(500, ge=1, description="Max blocking read time while idle.")
    dedupe_ttl: int = Field(86_400, ge=1, description="Seconds a job id stays bound to its entry "
                            "when the worker creates the binding (the SDK's dedupe_ttl_s).")
    dead_letter_maxlen: int = Field(10_000, ge=1, description="The dead-letter stream is capped at "
                                    "about this many entries.")
    dead_letter_payload_bytes: ByteSize = Field(65_536, ge=0, description="Bytes of a dead-lettered "
                                           "payload kept (size and truncated record the rest).")


WorkerLimits = limit_settings(WorkerRun)


class WorkerSettings(WorkerLimits):
    """Every knob of ``tokenrelay worker``: ``WorkerRun``'s, the job limits, then logging."""

    log_level: str = Field("info", description="debug, info, warning, error.")
    log_prompts: bool = Field(False, description="Log prompt text (debug only; off by default).")


    @field_validator("served_model_name")
    @classmethod
    def _served_model_name(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not SERVED_MODEL_NAME_RE.match(v):
            raise ValueError(f"served_model_name must be 1-256 printable characters without "
                             f"whitespace; got {v!r}")
        return v

    @field_validator("generation_config")
    @classmethod
    def _generation_config(cls, v: str) -> str:
        if v not in ("auto", "vllm") and not Path(v).is_dir():
            raise ValueError(f"generation_config must be auto, vllm (none) or a folder holding "
                             f"a generation_config.json; {v!r} is no folder")
        return v

    def served_model(self) -> str:
        """The name this worker serves under: ``--served-model-name``, else the default."""
        return self.served_model_name or default_served_model_name(self.model)

    @property
    def result_ttl_ms(self) -> int:
        """``--result-ttl`` in ms: the TTL of a job's result stream and owner record."""
        return int(self.result_ttl * 1000)

    def decode_limits(self) -> Limits:
        """The producer-facing limits ``decode_job`` checks, from the --max-* flags."""
        return Limits(**{name: getattr(self, name) for name in Limits.model_fields})

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for EngineConfig: every setting named as one of its fields (the
        job limits ``max_n`` and ``max_beam_width`` too: the engine holds the same bounds),
        unset ones left to the engine's defaults. Derived from EngineConfig's fields so a knob
        added to both is forwarded without a list to keep in step."""
        out = {n: getattr(self, n) for n in engine_config_fields() & set(type(self).model_fields)
               if getattr(self, n) is not None}
        out["model"] = self.model
        out["tensor_parallel_timeout"] = (self.tensor_parallel_timeout_s
                                          if self.tensor_parallel_timeout_s is not None
                                          else self.lease_ms / 2000)
        return out

    def engine_core_timeout(self) -> float:
        """How long a silent engine core process is given: the wait and the exit fit within
        the lease, so no other worker reclaims a job this one still streams."""
        if self.engine_core_timeout_s is not None:
            return self.engine_core_timeout_s
        return self.lease_ms / 2000


def engine_config_fields() -> set[str]:
    """EngineConfig's field names, read when an engine is configured (importing the engine's
    config imports torch, which ``tokenrelay health`` and ``admin`` must not pay for)."""
    from tokenrelay.engine.config import EngineConfig
    return {f.name for f in dataclasses.fields(EngineConfig)}


SERVED_MODEL_NAME_RE = re.compile(MODEL_NAME_PATTERN)


def default_served_model_name(model: Optional[str]) -> str:
    """A checkpoint folder's name (``/models/Qwen3-8B/`` -> ``Qwen3-8B``), ``fake`` for the
    ``fake:`` engine: what vLLM names a model it was not given a name for."""
    if not model:
        return ""
    if model.startswith("fake:"):
        return "fake"
    return Path(model.rstrip("/")).name or model


def default_device() -> str:
    try:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def default_worker_id(device: Optional[str] = None) -> str:
    dev = (device or default_device()).replace(":", "")
    if dev == "cuda":
        dev = "cuda0"
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname()) or "host"
    return f"{host}-{dev}"


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """``tokenrelay worker [flags]`` runs a worker; ``health`` and ``admin`` are subcommands of the
    same tree, so the connection flags may come before or after them."""
    from tokenrelay.worker.admin import configure_parser as configure_admin
    parser = argparse.ArgumentParser(
        prog="tokenrelay worker",
        description="tokenrelay worker: pulls jobs from Redis Streams, runs them on the engine, "
                    "streams tokens back.",
        epilog="subcommands: 'tokenrelay health' (exit 0 when the worker is alive), "
               "'tokenrelay admin {pending,workers,dead,drain}' (inspect and repair the "
               "queue); each takes --help.")
    add_settings_flags(parser, WorkerSettings)
    sub = parser.add_subparsers(dest="command", metavar="{health,admin}")
    health = sub.add_parser("health", help="exit 0 when the worker's heartbeat is fresh and its "
                                           "engine is loaded",
                            description="Exit 0 when the worker's heartbeat is fresh and its "
                                        "engine is loaded.")
    add_settings_flags(health, WorkerIdentity)
    configure_admin(sub.add_parser("admin", help="inspect and repair the queue: pending jobs, "
                                                 "workers, dead letters, drain"))
    return parser
