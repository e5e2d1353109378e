"""One decoder for Llama, Qwen2, Qwen3 and Mistral over a flattened ragged batch.

The families differ only by switches read from :class:`ModelConfig`: QKV bias (Qwen2), per-head
Q/K RMSNorm (Qwen3), output-projection bias (Llama ``attention_bias``) and tied embeddings.
Tokens of all sequences are concatenated (``input_ids[T]``, no padding); the attention layer
learns the layout from :class:`AttentionMetadata`, whose ``plan`` (the ModelRunner's, one per
step) says how the batch splits, and reads K/V from the paged cache.

Parameter names mirror Hugging Face's, except that q/k/v are fused into ``qkv_proj`` and
gate/up into ``gate_up_proj``; :meth:`DecoderForCausalLM.hf_weight_target` maps HF names.

Tensor parallelism: given a ``ParallelGroup`` the model holds one rank's share of every split
dimension (its :class:`Partition`) and its projections, embedding and LM head come from the
parallel-layer factories of engine/layers/tensor_parallel.py; without one they are the plain
layers.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tokenrelay.engine.layers import compiled_rope, cpu_gemm
from tokenrelay.engine.layers.attention import AttentionMetadata
from tokenrelay.engine.layers.linear import Linear, param
from tokenrelay.engine.layers.ops import Ops, get_ops
from tokenrelay.engine.layers.tensor_parallel import row_parallel, vocab_embedding
from tokenrelay.engine.layers.torch_ops import build_cos_sin_cache
from tokenrelay.engine.model_config import ModelConfig
from tokenrelay.engine.parallel.group import ParallelGroup
from tokenrelay.engine.parallel.partition import Partition

KVCache = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    """Holds the weight and eps; the computation is the backend's ``rms_norm`` op."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.weight = param(size, dtype=dtype, device=device)
        self.eps = eps


class Attention(nn.Module):
    """This rank's query and KV heads (all of them at size 1): QKV column-parallel, the output
    projection row-parallel (engine/layers/tensor_parallel.py)."""

    def __init__(self, cfg: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device | str,
                 part: Partition, group: Optional[ParallelGroup] = None):
        super().__init__()
        self.ops = ops
        self.num_heads = part.num_heads
        self.num_kv_heads = part.num_kv_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.split = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, cfg.qkv_bias, dtype, device)
        self.o_proj = row_parallel(q_size, cfg.hidden_size, cfg.o_bias, dtype, device, group)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache, cos_sin_cache: torch.Tensor) -> torch.Tensor:
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        parts = self._qkv_compiled(qkv, positions, cos_sin_cache)
        q, k, v = parts if parts is not None else self._qkv_eager(qkv, positions, cos_sin_cache)
        k_cache, v_cache = kv_cache
        self.ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = self.ops.attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    def _qkv_compiled(self, qkv: torch.Tensor, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """Split, Q/K norm and RoPE as one compiled kernel (engine/layers/compiled_rope.py)
        where the compiled CPU path is on; None elsewhere, or when it cannot compile."""
        if (self.ops.name != "torch-compiled" or qkv.dtype != torch.float32
                or qkv.device.type != "cpu"):
            return None
        qw = kw = None
        eps = 0.0
        if self.q_norm is not None:
            qw, kw, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
            if self.k_norm.eps != eps:
                return None
        return compiled_rope.run(qkv, positions, cos_sin_cache, qw, kw, eps, self.num_heads,
                                 self.num_kv_heads)

    def _qkv_eager(self, qkv: torch.Tensor, positions: torch.Tensor,
                   cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = qkv.shape[0]
        q, k, v = qkv.split(self.split, dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim).contiguous()
        if self.q_norm is not None:
            q = self.ops.rms_norm(q.reshape(-1, self.head_dim), self.q_norm.weight,
                                  self.q_norm.eps).view(t, self.num_heads, self.head_dim)
            k = self.ops.rms_norm(k.reshape(-1, self.head_dim), self.k_norm.weight,
                                  self.k_norm.eps).view(t, self.num_kv_heads, self.head_dim)
        q, k = q.contiguous(), k.contiguous()
        self.ops.rotary(q, k, positions, cos_sin_cache, True)
        return q, k, v


class MLP(nn.Module):
    """This rank's intermediate columns: gate/up column-parallel, down row-parallel."""

    def __init__(self, cfg: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device | str,
                 part: Partition, group: Optional[ParallelGroup] = None):
        super().__init__()
        self.ops = ops
        inter = part.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * inter, False, dtype, device)
        self.down_proj = row_parallel(inter, cfg.hidden_size, False, dtype, device, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device | str,
                 part: Partition, group: Optional[ParallelGroup] = None):
        super().__init__()
        self.ops = ops
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, ops, dtype, device, part, group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, ops, dtype, device, part, group)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata, kv_cache: KVCache, cos_sin_cache: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        norm = self.input_layernorm
        if residual is None:
            residual = hidden
            hidden = self.ops.rms_norm(hidden, norm.weight, norm.eps)
        else:
            hidden = self.ops.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
        hidden = self.self_attn(positions, hidden, meta, kv_cache, cos_sin_cache)
        norm = self.post_attention_layernorm
        hidden = self.ops.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device | str,
                 part: Partition, group: Optional[ParallelGroup] = None):
        super().__init__()
        self.embed_tokens = vocab_embedding(part, cfg.hidden_size, dtype, device, group)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, dtype, device, part, group)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class DecoderForCausalLM(nn.Module):
    """``forward(input_ids[T], positions[T], meta, kv_caches) -> hidden[T, H]``;
    ``compute_logits(hidden[N, H]) -> [N, vocab] float32``."""

    # HF projection name -> (our fused module, index of its shard in the fused rows)
    PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", ops: Ops | None = None,
                 group: Optional[ParallelGroup] = None) -> None:
        """``group``: this rank's tensor-parallel group; the model then holds only this rank's
        share of every split dimension (engine/parallel/partition.py)."""
        super().__init__()
        self.config = config
        self.ops = ops or get_ops("torch")
        self.dtype = dtype
        self.group = group
        self.partition = (Partition.of(config) if group is None
                          else Partition.of(config, group.rank, group.size))
        part = self.partition
        self.model = DecoderModel(config, self.ops, dtype, device, part, group)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, part.vocab_per_rank, False, dtype, device)
            if group is not None:
                self.lm_head.weight.data.zero_()    # padding rows stay zero
        # float32 on purpose: cos/sin are cast to the activation dtype at use, like transformers.
        self.register_buffer("cos_sin_cache", build_cos_sin_cache(
            config.head_dim, config.max_position_embeddings, config.rope_theta,
            config.rope_scaling, device), persistent=False)
        self.lm_head_packed: cpu_gemm.PackedWeight | None = None

    def prepack_cpu_weights(self, backend: str = "auto") -> int:
        """Pack every projection and the LM head for a packed GEMM (CPU float32 only; a no-op
        elsewhere). Call once the weights are loaded. Returns how many were packed."""
        linears = [m for m in self.modules() if isinstance(m, Linear) and m is not self.lm_head]
        count = sum(m.prepack(backend) for m in linears)
        self.lm_head_packed = cpu_gemm.pack(self.lm_head_weight, None, backend)
        return count + (self.lm_head_packed is not None)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache]) -> torch.Tensor:
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for a model with "
                             f"{len(self.model.layers)} layers; pass one (k, v) pair per layer")
        hidden = self.model.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, meta, kv_cache,
                                     self.cos_sin_cache)
        norm = self.model.norm
        return self.ops.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        """Logits in the model dtype (as transformers computes them), returned as float32.
        Tensor-parallel: each rank computes its vocabulary rows and rank 0 gets them all
        (other ranks get None).

        On CPU the product is taken as ``W @ h^T`` (vocab rows as the GEMM's M): for the few
        rows a step samples, MKL runs that ~1.2-2x faster than ``h @ W^T`` on the bench's 32000
        x 512 head (measured 53 -> 38 ms at 48 rows, 25 -> 21 ms at 8); the transpose back is a
        cheap copy."""
        if self.group is not None:
            return self.group.gather_vocab(self._logits(hidden), self.config.vocab_size)
        return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.lm_head_weight
        if self.lm_head_packed is not None and hidden.shape[0] > 0:
            return cpu_gemm.linear(hidden, self.lm_head_packed, weight, None).float()
        if hidden.device.type == "cpu":
            return torch.mm(weight, hidden.t()).t().contiguous().float()
        return F.linear(hidden, weight).float()

    def hf_weight_target(self, hf_name: str) -> tuple[str, int | None] | None:
        """Map a Hugging Face tensor name to ``(our parameter name, shard index or None)``;
        ``None`` means the tensor is not used (rotary buffers, a tied lm_head copy)."""
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None
        if hf_name == "lm_head.weight" and self.lm_head is None:
            return None
        for hf_part, (ours, shard) in self.PACKED.items():
            token = f".{hf_part}."
            if token in hf_name:
                return hf_name.replace(token, f".{ours}."), shard
        return hf_name, None

    def shard_rows(self, fused: str, shard: int) -> slice:
        """Rows of a fused ``qkv_proj``/``gate_up_proj`` parameter that hold shard ``shard``
        (of this rank's share)."""
        part = self.partition
        if fused == "qkv_proj":
            q = part.num_heads * part.head_dim
            kv = part.num_kv_heads * part.head_dim
            starts = [0, q, q + kv, q + 2 * kv]
        else:
            i = part.intermediate_size
            starts = [0, i, 2 * i]
        return slice(starts[shard], starts[shard + 1])
