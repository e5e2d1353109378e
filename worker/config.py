"""Worker settings: one pydantic-settings model, filled from ``TOKENRELAY_<NAME>`` env vars and CLI flags.

The CLI is generated from the model's fields so that a flag, its env var and its default can never
drift apart: every field ``foo_bar`` is ``--foo-bar`` and ``TOKENRELAY_FOO_BAR``. Flags win over
env vars, env vars over defaults.
"""

from __future__ import annotations

import argparse
import re
import socket
from typing import Any, Optional, Sequence

from pydantic import ByteSize, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from producer_sdk.protocol import PARKING_CONSUMER, Keys, Limits

class WorkerSettings(BaseSettings):
    """Every knob of ``python -m worker``. ``None`` engine options mean "the engine's default"."""

    model_config = SettingsConfigDict(env_prefix="TOKENRELAY_", extra="ignore",
                                      validate_default=True)

    model: Optional[str] = Field(None, description="Hugging Face checkpoint folder to serve.")
    redis_url: str = Field("redis://localhost:6379/0",
                           description="redis:// or rediss:// URL; user:password@ works.")
    namespace: str = Field("tokenrelay", description="Key prefix shared with the producers.")
    queue: str = Field("default", description="Queue name (jobs stream <ns>:jobs:<queue>).")
    worker_id: Optional[str] = Field(
        None, description="Consumer name; must be stable across restarts. Default: host-device.")
    device: Optional[str] = Field(None, description="cuda, cuda:1, cpu; default: cuda if present.")
    dtype: str = Field("auto", description="auto, float32, float16, bfloat16.")
    max_num_seqs: Optional[int] = Field(None, ge=1, description="Max running sequences.")
    max_num_batched_tokens: Optional[int] = Field(None, ge=1, description="Token budget per step.")
    block_size: Optional[int] = Field(None, ge=1, description="KV cache block size in tokens.")
    kv_cache_memory: Optional[ByteSize] = Field(None, ge=1, description="KV pool size, e.g. 2GiB.")
    num_kv_blocks: Optional[int] = Field(None, ge=1, description="KV pool size in blocks "
                                         "(overrides --kv-cache-memory).")
    max_model_len: Optional[int] = Field(None, ge=1, description="Max prompt+output tokens.")
    enable_prefix_caching: Optional[bool] = Field(None, description="Reuse cached prompt prefixes.")
    attention_backend: Optional[str] = Field(None, description="torch, triton or auto.")
    enforce_eager: Optional[bool] = Field(
        None, description="No CUDA graphs (GPU) and no compiled kernels (CPU float32): "
                          "seconds less start-up, slower steps.")
    result_ttl: float = Field(3600.0, gt=0, description="Seconds a result stream lives after its "
                              "last write.")
    drain_timeout: float = Field(30.0, ge=0, description="Seconds running jobs get to finish on "
                                 "SIGTERM before they are handed back.")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus port; 0 disables.")
    metrics_host: str = Field("0.0.0.0", description="Address the metrics server binds.")
    lease_ms: int = Field(30000, ge=100, description="Lease on held jobs; renewed every lease/3.")
    max_deliveries: int = Field(3, ge=1, description="Deliveries before a job is dead-lettered.")
    heartbeat_ms: int = Field(1000, ge=50, description="Heartbeat interval.")
    block_ms: int = Field(500, ge=1, description="Max blocking read time while idle.")
    dedupe_ttl: int = Field(86_400, ge=1, description="Seconds a job id stays bound to its entry "
                            "when the worker creates the binding (the SDK's dedupe_ttl_s).")
    dead_letter_maxlen: int = Field(10_000, ge=1, description="The dead-letter stream is capped at "
                                    "about this many entries.")
    dead_letter_payload_bytes: ByteSize = Field(65_536, ge=0, description="Bytes of a dead-lettered "
                                           "payload kept (size and truncated record the rest).")
    # Producer-facing limits (producer_sdk.protocol.Limits), checked by decode_job: a job past
    # one ends alone with invalid_request naming the field.
    max_payload_bytes: ByteSize = Field(8 * 1024 * 1024, ge=1, description="Largest job payload "
                                   "(checked before unpacking).")
    max_prompt_bytes: ByteSize = Field(4 * 1024 * 1024, ge=1, description="Largest prompt (or sum of "
                                  "message contents), UTF-8 bytes.")
    max_prompt_token_ids: int = Field(1_000_000, ge=1, description="Most prompt_token_ids.")
    max_messages: int = Field(10_000, ge=1, description="Most chat messages.")
    max_stop_strings: int = Field(64, ge=0, description="Most stop strings per job.")
    max_stop_string_chars: int = Field(512, ge=1, description="Longest stop string.")
    max_stop_token_ids: int = Field(1024, ge=0, description="Most stop token ids per job.")
    max_metadata_bytes: ByteSize = Field(64 * 1024, ge=0, description="Largest metadata (packed).")
    max_metadata_depth: int = Field(32, ge=1, description="Deepest metadata nesting.")
    max_logprobs: int = Field(20, ge=0, description="Largest logprobs (top-k per token).")
    max_n: int = Field(16, ge=1, description="Largest n (sampled choices per job).")
    max_beam_width: int = Field(16, ge=1, description="Largest beam_width (beam search beams "
                                "per job).")
    log_level: str = Field("info", description="debug, info, warning, error.")
    log_prompts: bool = Field(False, description="Log prompt text (debug only; off by default).")


    @field_validator("namespace", "queue")
    @classmethod
    def _key_part(cls, v: str) -> str:
        if not v or any(c in v for c in "{}: \t\n"):
            raise ValueError("must be non-empty without braces, colons or whitespace")
        return v

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

    def decode_limits(self) -> Limits:
        """The producer-facing limits ``decode_job`` checks, from the --max-* flags."""
        return Limits(**{name: getattr(self, name) for name in Limits.model_fields})

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for EngineConfig; unset options keep the engine's defaults."""
        names = ("device", "dtype", "max_num_seqs", "max_num_batched_tokens", "block_size",
                 "kv_cache_memory", "num_kv_blocks", "max_model_len", "enable_prefix_caching", "attention_backend",
                 "enforce_eager")
        out = {n: getattr(self, n) for n in names if getattr(self, n) is not None}
        out["model"] = self.model
        return out


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

def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# What an unset (None) setting means, for --help.
_NONE_MEANS = {"model": "none, required", "worker_id": "<hostname>-<device>",
               "device": "cuda when available, else cpu"}


def add_setting_flags(parser: argparse.ArgumentParser, only: Optional[Sequence[str]] = None) -> None:
    """One flag per settings field. Defaults are SUPPRESSed so env vars are not overridden."""
    for name, field in WorkerSettings.model_fields.items():
        if only is not None and name not in only:
            continue
        env = f"TOKENRELAY_{name.upper()}"
        default = _NONE_MEANS.get(name, "the engine's") if field.default is None else field.default
        help_text = f"{field.description or ''} [env {env}; default: {default}]"
        annotation = str(field.annotation)
        if "bool" in annotation:
            parser.add_argument(_flag(name), dest=name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(_flag(name), dest=name, default=argparse.SUPPRESS, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m worker",
        description="tokenrelay worker: pulls jobs from Redis Streams, runs them on the engine, "
                    "streams tokens back.",
        epilog="subcommands: 'python -m worker health' (exit 0 when the worker is alive), "
               "'python -m worker admin {pending,workers,dead,drain}' (inspect and repair the "
               "queue); each takes --help.")
    add_setting_flags(parser)
    return parser


def build_health_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m worker health",
        description="Exit 0 when the worker's heartbeat is fresh and its engine is loaded.")
    add_setting_flags(parser, only=("redis_url", "namespace", "queue", "worker_id", "device",
                                    "heartbeat_ms"))
    return parser


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    """Flags over env vars over defaults (pydantic-settings gives init kwargs precedence)."""
    return WorkerSettings(**vars(args))


def describe_settings_error(exc: ValidationError) -> str:
    """One line per bad setting, named as the user typed it (flag and environment variable)."""
    lines = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err.get("loc") else "settings"
        flag, env = "--" + name.replace("_", "-"), "TOKENRELAY_" + name.upper()
        lines.append(f"{flag} / {env}: {err['msg']} (got {err.get('input')!r:.60})")
    return "; ".join(lines)
