"""Parse a Hugging Face ``config.json`` into the few numbers the decoder needs.

One dataclass covers Llama, Qwen2, Qwen3 and Mistral: they differ only in switches (QKV bias,
per-head Q/K norm, tied embeddings). Anything the decoder cannot reproduce exactly is rejected
here with :class:`UnsupportedModelError`, so a bad checkpoint fails at load, not with wrong tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenrelay.engine.errors import UnsupportedModelError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")    # "org/name", as on the Hugging Face hub

# architectures entry -> family; model_type -> family (fallback when `architectures` is absent).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}
_MODEL_TYPES = {family: family for family in SUPPORTED_ARCHITECTURES.values()}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling; ``rope_type`` is one of ``SUPPORTED_ROPE_TYPES`` minus "default"."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None


@dataclass
class ModelConfig:
    """Decoder hyper-parameters, normalised across the supported families."""

    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False          # Qwen2 always; Llama/Mistral with attention_bias
    o_bias: bool = False            # Llama/Mistral with attention_bias only
    qk_norm: bool = False           # Qwen3: per-head RMSNorm on q and k before RoPE
    sliding_window: int | None = None   # not implemented: callers must keep max_model_len <= it
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed config.json; raises UnsupportedModelError for what we cannot run."""
        family, architecture = _family(raw)
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act={act!r} is not supported; only 'silu' is")
        if raw.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=true is not supported by the engine's decoder")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            kv_heads = int(raw.get("num_key_value_heads") or heads)
            head_dim = int(raw.get("head_dim") or hidden // heads)
            cfg = cls(
                architecture=architecture,
                family=family,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=head_dim,
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_list(raw.get("eos_token_id")),
                pad_token_id=raw.get("pad_token_id"),
            )
        except KeyError as exc:
            raise UnsupportedModelError(f"config.json lacks required key {exc.args[0]!r}") from exc
        if heads % kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        cfg.rope_theta, cfg.rope_scaling = _rope(raw)
        if family == "qwen2":
            cfg.qkv_bias = True
        elif family == "qwen3":
            cfg.qk_norm = True
            cfg.qkv_bias = cfg.o_bias = bool(raw.get("attention_bias", False))
        else:
            cfg.qkv_bias = cfg.o_bias = bool(raw.get("attention_bias", False))
        uses_window = family == "mistral" or raw.get("use_sliding_window", False)
        window = raw.get("sliding_window") if uses_window else None
        if window is not None and int(window) < cfg.max_position_embeddings:
            cfg.sliding_window = int(window)
        return cfg

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Read ``config.json`` (and eos ids from ``generation_config.json``) in folder ``path``."""
        folder = Path(path)
        cfg_file = folder / "config.json"
        if not folder.exists() and _HUB_ID.match(str(path)):
            raise FileNotFoundError(
                f"{path!r} looks like a Hugging Face hub id, and there is no such folder: "
                "tokenrelay loads local checkpoint folders and never downloads; fetch it "
                f"elsewhere (`huggingface-cli download {path} --local-dir DIR`) and pass DIR, "
                "or the snapshot folder of a mounted Hugging Face cache")
        if not cfg_file.is_file():
            raise FileNotFoundError(
                f"no config.json in {folder}: pass a Hugging Face checkpoint folder "
                "(make one with `python -m tokenrelay.engine.tiny OUT` or `tokenrelay fetch smollm2 "
                "OUT`)")
        cfg = cls.from_dict(json.loads(cfg_file.read_text()))
        gen_file = folder / "generation_config.json"
        if gen_file.is_file():
            gen = json.loads(gen_file.read_text())
            for tok in _as_list(gen.get("eos_token_id")):
                if tok not in cfg.eos_token_ids:
                    cfg.eos_token_ids.append(tok)
        return cfg


# generation_config.json's sampling keys (transformers' names) -> SamplingParams' names: what
# vLLM's ``--generation-config auto`` applies where a request leaves them unset.
GENERATION_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                           "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                           "max_new_tokens": "max_tokens"}


def generation_defaults(folder: str | Path) -> dict[str, Any]:
    """The sampling defaults a checkpoint recommends (``generation_config.json`` in
    ``folder``), under SamplingParams' names, only those it sets; {} without the file. The
    values are the file's, unchecked: the caller validates them."""
    gen_file = Path(folder) / "generation_config.json"
    if not gen_file.is_file():
        return {}
    gen = json.loads(gen_file.read_text())
    if not isinstance(gen, dict):
        raise ValueError(f"{gen_file} is not a JSON object")
    return {ours: gen[theirs] for theirs, ours in GENERATION_DEFAULT_KEYS.items()
            if gen.get(theirs) is not None}


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _family(raw: dict[str, Any]) -> tuple[str, str]:
    archs = raw.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch], arch
    model_type = raw.get("model_type")
    if not archs and model_type in _MODEL_TYPES:
        family = _MODEL_TYPES[model_type]
        arch = next(a for a, f in SUPPORTED_ARCHITECTURES.items() if f == family)
        return family, arch
    found = archs or model_type
    raise UnsupportedModelError(
        f"unsupported architecture {found!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Return (theta, scaling), reading both the classic ``rope_theta``/``rope_scaling`` keys
    and transformers 5's ``rope_parameters`` (which may hold theta too)."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise UnsupportedModelError("per-layer rope parameters are not supported")
    merged = {**params, **scaling}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    try:
        factor = float(merged["factor"])
        if rope_type == "linear":
            return theta, RopeScaling("linear", factor)
        return theta, RopeScaling(
            "llama3", factor,
            low_freq_factor=float(merged["low_freq_factor"]),
            high_freq_factor=float(merged["high_freq_factor"]),
            original_max_position_embeddings=int(merged["original_max_position_embeddings"]))
    except KeyError as exc:
        raise UnsupportedModelError(
            f"rope scaling {rope_type!r} lacks parameter {exc.args[0]!r}") from exc
