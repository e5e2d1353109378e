"""Load a Hugging Face checkpoint folder into :class:`DecoderForCausalLM`, and its tokenizer.

Reads ``model.safetensors`` or the shards named by ``model.safetensors.index.json``, maps HF
parameter names (fusing q/k/v and gate/up rows) and casts to the requested dtype. Every model
parameter must be filled and every checkpoint tensor used, so a mismatched checkpoint fails here
with the offending names instead of producing silent garbage.

A tensor-parallel rank reads only its slice of each split tensor (safetensors' ``get_slice``,
narrowed as it is read, see ``engine.layers.tensor_parallel.checkpoint_slice``): no rank ever
holds the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tokenrelay.engine.errors import UnsupportedModelError
from tokenrelay.engine.layers.ops import get_ops
from tokenrelay.engine.layers.tensor_parallel import SKIP, Slice, checkpoint_slice
from tokenrelay.engine.model_config import ModelConfig
from tokenrelay.engine.models.decoder import DecoderForCausalLM

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
          "half": torch.float16, "float": torch.float32}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def resolve_dtype(dtype: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    """``"auto"`` -> the checkpoint's ``torch_dtype``; names or torch dtypes pass through."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = config.torch_dtype if dtype == "auto" else dtype
    name = name.removeprefix("torch.")
    if name not in DTYPES:
        raise UnsupportedModelError(
            f"dtype {name!r} is not supported; use one of auto, float32, float16, bfloat16")
    return DTYPES[name]


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of checkpoint folder ``path`` (sharded or single)."""
    folder = Path(path)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} names shards that are missing: {missing}")
        return files
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"no {SINGLE_FILE} or {INDEX_FILE} in {folder}; only safetensors checkpoints are supported")


def load_model(path: str | Path, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "cpu", backend: str = "torch",
               compiled: bool = False, group: Any = None) -> DecoderForCausalLM:
    """Build the decoder for checkpoint folder ``path`` and fill it with its weights.
    ``compiled``: see ``engine.layers.ops.get_ops``; ``group``: this rank's
    ``ParallelGroup`` (it then loads only its share)."""
    config = ModelConfig.from_pretrained(path)
    torch_dtype = resolve_dtype(dtype, config)
    files = checkpoint_files(path)
    model = DecoderForCausalLM(config, dtype=torch_dtype, device=device,
                               ops=get_ops(backend, compiled), group=group)
    params = dict(model.named_parameters())
    # A fused parameter is complete only when all its shards arrived.
    pending: dict[str, set[int | None]] = {}
    for name in params:
        module = name.rsplit(".", 2)[-2]
        pending[name] = {0, 1, 2} if module == "qkv_proj" else (
            {0, 1} if module == "gate_up_proj" else {None})
    unexpected: list[str] = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as reader:
            for hf_name in reader.keys():
                target = model.hf_weight_target(hf_name)
                if target is None:
                    continue
                ours, shard = target
                narrow = checkpoint_slice(ours, shard, model.partition)
                if narrow == SKIP:
                    continue
                if ours not in params:
                    unexpected.append(hf_name)
                    continue
                _copy(model, params[ours], ours, shard, _read(reader, hf_name, narrow), hf_name,
                      narrow)
                pending[ours].discard(shard)
    if unexpected:
        raise UnsupportedModelError(
            f"checkpoint has tensors this {config.architecture} decoder does not use: "
            f"{unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    missing = [name for name, left in pending.items() if left]
    if missing:
        raise UnsupportedModelError(
            f"checkpoint lacks weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return model.eval()


def _read(reader: Any, hf_name: str, narrow: Slice | None) -> torch.Tensor:
    """The whole tensor, or just the rows / columns ``narrow`` names (read as narrowed)."""
    if narrow is None:
        return reader.get_tensor(hf_name)
    view = reader.get_slice(hf_name)
    shape = view.get_shape()
    if len(shape) <= narrow.dim or shape[narrow.dim] < narrow.stop:
        raise UnsupportedModelError(
            f"{hf_name} has shape {tuple(shape)}, config.json implies at least {narrow.stop} "
            f"along dimension {narrow.dim}")
    if narrow.dim == 0:
        return view[narrow.start:narrow.stop]
    return view[:, narrow.start:narrow.stop]


def _copy(model: DecoderForCausalLM, param: torch.Tensor, ours: str, shard: int | None,
          tensor: torch.Tensor, hf_name: str, narrow: Slice | None = None) -> None:
    dest = param.data
    if shard is not None:
        fused = ours.rsplit(".", 2)[-2]
        dest = dest[model.shard_rows(fused, shard)]
    if narrow is not None and narrow.padded:
        dest = dest[:narrow.stop - narrow.start]     # the vocabulary's padding rows stay zero
    if dest.shape != tensor.shape:
        raise UnsupportedModelError(
            f"{hf_name} has shape {tuple(tensor.shape)}, config.json implies {tuple(dest.shape)}")
    dest.copy_(tensor)


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer as a transformers fast tokenizer (chat template included)."""
    folder = Path(path)
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json or tokenizer_config.json in {folder}")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
