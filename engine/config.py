"""EngineConfig: every knob of the engine, i.e. the keyword arguments of ``LLM(model=..., **kw)``.

The config is resolved once, at engine start: ``resolve()`` reads the checkpoint's config.json
(``engine.model_config.ModelConfig``) for the shapes the KV cache needs and picks the device,
dtype and max_model_len defaults. The number
of KV blocks is decided later by the ModelRunner (it needs the loaded weights to measure free
GPU memory), through ``kv_block_bytes`` and ``num_kv_blocks_for``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

import torch

from tokenrelay.engine.layers import cpu_gemm
from tokenrelay.engine.model_config import ModelConfig
from tokenrelay.engine.parallel.partition import Partition, check_size

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}

# On CPU there is no "free memory after weights" to measure, so the default pool is a fixed
# budget that fits beside a small model on a laptop (SmolLM2-135M in float32: ~23k tokens of
# KV), capped so we never allocate more than max_num_seqs full-length sequences could use.
# A server sets --kv-cache-memory-bytes (vLLM's name; its CPU backend's VLLM_CPU_KVCACHE_SPACE).
CPU_DEFAULT_KV_CACHE_BYTES = 1024**3
# Activations of the largest step, per batched token: a generous estimate for the models we
# serve (hidden states, the MLP's intermediate, attention scratch), kept out of the KV budget.
ACTIVATION_BYTES_PER_TOKEN = 64 * 1024


@dataclass
class EngineConfig:
    """Engine settings. ``None`` means "pick a sensible default at resolve time".

    KV pool size, in order of precedence: ``num_kv_blocks``, then ``kv_cache_memory_bytes``,
    then on CUDA what ``gpu_memory_utilization`` leaves (vLLM's meaning: the fraction of the
    card's memory this engine may use for weights, activations and KV cache together, whatever
    other processes on the card hold; see ``gpu_kv_budget``), else ``CPU_DEFAULT_KV_CACHE_BYTES``.
    A pool smaller than ``max_model_len`` is fine: only requests that could never fit are
    refused.
    """

    model: str
    dtype: Union[str, torch.dtype] = "auto"
    device: Optional[str] = None
    block_size: int = 16
    num_kv_blocks: Optional[int] = None
    kv_cache_memory_bytes: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    enable_prefix_caching: bool = True
    # Upper bounds on SamplingParams.n and beam_width: a request past them is refused.
    max_n: int = 16
    max_beam_width: int = 16
    attention_backend: str = "auto"
    # Unless True: on CUDA with the triton backend decode steps replay CUDA graphs
    # (engine/layers/cuda_graphs.py); on CPU in float32 decode attention and Q/K norm + RoPE
    # run kernels compiled by torch.compile at start-up (engine/layers/compiled_decode.py,
    # engine/layers/compiled_rope.py; seconds, once per process).
    enforce_eager: bool = False
    # CPU float32: keep packed copies of the projection weights (engine/layers/cpu_gemm.py),
    # 2-3x faster linears at decode batch sizes for about the weights' memory again.
    cpu_prepack_weights: bool = True
    # Which packed GEMM: "onednn", "mkl", or "auto" (time both per weight shape at load).
    cpu_gemm_backend: str = "auto"
    seed: int = 0
    # Structured outputs (engine/grammar.py): grammars compile on this many threads, off the
    # step loop; a request whose grammar is not ready within the timeout ends with
    # invalid_request (the cache remembers a spec whose compile itself ran that long).
    grammar_compile_threads: int = 2
    grammar_compile_timeout_s: float = 10.0
    # Ranks the model is split over (vLLM's name): query/KV heads, MLP columns and the
    # vocabulary are divided among them (engine/parallel/). Rank 0 runs in this process; the
    # others are spawned processes, on the next CUDA devices (cuda:k+r) or on CPU with gloo.
    tensor_parallel_size: int = 1
    # Seconds a rank may wait in a collective (and at least 120 s for the ranks to start and
    # join) before the engine gives up on the group: a hung rank fails it after this long.
    tensor_parallel_timeout: float = 120.0
    # Overlapped engine core (engine/overlap.py): schedule and launch step N+1 before step N's
    # results are processed. None = on for one CUDA device, off on CPU (where the "device" is
    # these same cores and the overlap only moves work between threads).
    async_scheduling: Optional[bool] = None
    # Serve a simulated device instead of the checkpoint's weights: each forward pass takes
    # this many milliseconds, the GIL released (engine/simulated.py). For measuring the
    # serving stack around a GPU-like step on any machine; its text means nothing.
    simulated_device_ms: Optional[float] = None
    # Filled by resolve(): the checkpoint's config.json, parsed.
    hf_config: Optional[ModelConfig] = field(default=None, repr=False)

    def resolve(self) -> "EngineConfig":
        """Validate the knobs and fill every default; returns self for chaining."""
        self.model = str(self.model)
        if self.hf_config is None:
            self.hf_config = ModelConfig.from_pretrained(self.model)
        if self.device is None:
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = str(self.device)
        self.dtype = self._resolve_dtype()
        if self.attention_backend not in ("torch", "triton", "auto"):
            raise ValueError(f"attention_backend must be 'torch', 'triton' or 'auto', "
                             f"got {self.attention_backend!r}")
        if self.cpu_gemm_backend not in ("auto", *cpu_gemm.BACKENDS):
            raise ValueError(f"cpu_gemm_backend must be 'auto' or one of {cpu_gemm.BACKENDS}, "
                             f"got {self.cpu_gemm_backend!r}")
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if self.device.startswith("cuda") else "torch"
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0, "
                             f"got {self.grammar_compile_timeout_s}")
        for name in ("block_size", "max_num_seqs", "max_n", "max_beam_width",
                     "grammar_compile_threads"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_size(self.hf_config, self.tensor_parallel_size)
        if self.tensor_parallel_size > 1:
            from tokenrelay.engine.parallel.group import rank_devices
            rank_devices(self.device, self.tensor_parallel_size)    # enough devices?
        if self.simulated_device_ms is not None and not self.simulated_device_ms >= 0:
            raise ValueError(f"simulated_device_ms must be >= 0, got {self.simulated_device_ms}")
        if not self.tensor_parallel_timeout > 0:
            raise ValueError(f"tensor_parallel_timeout must be > 0 seconds, "
                             f"got {self.tensor_parallel_timeout}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < self.kv_block_bytes():
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} bytes is less than one KV "
                             f"block ({self.kv_block_bytes()} bytes)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        limit = self.hf_config.max_position_embeddings
        if self.hf_config.sliding_window is not None:  # the decoder attends to everything
            limit = min(limit, self.hf_config.sliding_window)
        if self.max_model_len is None:
            self.max_model_len = limit
        elif not 1 <= self.max_model_len <= limit:
            raise ValueError(f"max_model_len={self.max_model_len} must be in [1, {limit}] "
                             f"(the checkpoint's max_position_embeddings or sliding_window)")
        if self.max_num_batched_tokens is None:
            # Large enough that a typical prompt is one chunk; small enough that a step of
            # prefill does not stall decodes for long.
            self.max_num_batched_tokens = max(2048, self.max_num_seqs)
        if self.async_scheduling is None:
            self.async_scheduling = (self.device.startswith("cuda")
                                     and self.tensor_parallel_size == 1)
        elif self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling needs tensor_parallel_size=1 (the ranks are fed "
                             "host-side inputs); leave it unset or set it to False")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, "
                             f"got {self.max_num_batched_tokens}")
        return self

    def _resolve_dtype(self) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        name = str(self.dtype).lower().replace("torch.", "")
        if name == "auto":
            if not self.device.startswith("cuda"):
                return torch.float32  # half precision matmuls are slow on most CPUs
            name = str(self.hf_config.torch_dtype or "bfloat16").replace("torch.", "")
            if name == "float32":
                return torch.float32
            return _DTYPES.get(name, torch.bfloat16)
        if name not in _DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        return _DTYPES[name]

    def kv_block_bytes(self) -> int:
        """Bytes of one KV block across all layers (K and V), on one rank: with tensor
        parallelism each rank holds its own KV heads of every block, and the memory knobs
        (``kv_cache_memory_bytes``, ``gpu_memory_utilization``, the CPU default) are per rank."""
        c = self.hf_config
        elem = torch.empty((), dtype=self.dtype if isinstance(self.dtype, torch.dtype)
                           else torch.float32).element_size()
        kv_heads = Partition.of(c, 0, self.tensor_parallel_size).num_kv_heads
        return 2 * c.num_hidden_layers * self.block_size * kv_heads * c.head_dim * elem

    def max_useful_blocks(self) -> int:
        """More blocks than this could never be in use at once."""
        return self.max_num_seqs * math.ceil(self.max_model_len / self.block_size)

    def num_kv_blocks_for(self, free_bytes: Optional[int] = None) -> int:
        """How many blocks the pool gets, given the bytes free for it (CUDA) or None (CPU)."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        if self.kv_cache_memory_bytes is not None:
            return max(1, self.kv_cache_memory_bytes // self.kv_block_bytes())
        budget = free_bytes if free_bytes is not None else CPU_DEFAULT_KV_CACHE_BYTES
        blocks = budget // self.kv_block_bytes()
        if blocks < 1:
            raise ValueError("not enough memory left for even one KV block; lower max_model_len, "
                             "raise gpu_memory_utilization or pass num_kv_blocks")
        return int(min(blocks, self.max_useful_blocks()))


@dataclass(frozen=True)
class CudaMemory:
    """One reading of a CUDA device's memory: the card's (``torch.cuda.mem_get_info``) and what
    this process's torch allocator holds (``torch.cuda.memory_reserved``)."""

    total: int
    free: int
    reserved: int


def gpu_kv_budget(utilization: float, before: CudaMemory, after: CudaMemory,
                  activations: int) -> int:
    """Bytes the KV pool may take on a CUDA device, given readings before and after the
    weights were loaded.

    Why per process: two workers sharing a card with ``--gpu-memory-utilization 0.45`` each must
    each get their own share; counting the other's memory as ours (total minus free) left the
    second one nothing. Ours is what torch reserved since ``before`` plus what free memory lost
    beyond that (CUDA libraries' workspaces outside the allocator; another process growing at
    the same moment is counted too, which only errs towards a smaller pool). The result never
    exceeds what is actually free, less the activations of the largest step."""
    torch_growth = max(0, after.reserved - before.reserved)
    non_torch = max(0, (before.free - after.free) - torch_growth)
    ours = after.reserved + non_torch
    budget = int(after.total * utilization) - ours - activations
    return min(budget, after.free - activations)
