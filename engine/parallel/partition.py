"""What one tensor-parallel rank holds of each split dimension, and which sizes a model allows.

Megatron-style split, as vLLM does it: query heads, KV heads and the MLP's intermediate size
are divided evenly among the ranks; when there are more ranks than KV heads, each KV head is
replicated on ``size // num_key_value_heads`` consecutive ranks (their query heads all read that
one head, so attention stays exact). The vocabulary is padded up to a multiple of the size;
the padded rows are zero and their logits are cut off before sampling, so they are never
sampled. The hidden size is never split (it is what the all-reduces sum).

Everything here is checked when the engine's config is resolved, before any process starts, and
each refusal names the dimension and the sizes that would fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenrelay.engine.errors import UnsupportedModelError
from tokenrelay.engine.model_config import ModelConfig

# Sizes listed in an error message as "sizes that fit this model" are at most this large.
_LISTED_SIZES = 64


@dataclass(frozen=True)
class Partition:
    """One rank's share. For ``size == 1`` every field is the whole model's."""

    rank: int
    size: int
    head_dim: int
    num_heads: int              # query heads on this rank
    num_kv_heads: int           # KV heads on this rank (1 when replicated)
    kv_head_start: int          # first KV head of the checkpoint this rank holds
    intermediate_size: int      # MLP columns on this rank
    vocab_size: int             # the model's real vocabulary
    vocab_per_rank: int         # embedding / LM head rows on this rank (padding included)

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int = 0, size: int = 1) -> "Partition":
        """Rank ``rank``'s share at ``size`` ranks; UnsupportedModelError when the model's
        shapes do not split ``size`` ways."""
        check_size(cfg, size)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a tensor-parallel group of {size}")
        hkv = cfg.num_key_value_heads
        if size <= hkv:
            kv_heads, kv_start = hkv // size, rank * (hkv // size)
        else:
            kv_heads, kv_start = 1, rank // (size // hkv)
        return cls(rank=rank, size=size, head_dim=cfg.head_dim,
                   num_heads=cfg.num_attention_heads // size, num_kv_heads=kv_heads,
                   kv_head_start=kv_start, intermediate_size=cfg.intermediate_size // size,
                   vocab_size=cfg.vocab_size, vocab_per_rank=-(-cfg.vocab_size // size))

    @property
    def q_rows(self) -> tuple[int, int]:
        """[start, stop) of this rank's query rows in q_proj (and columns of o_proj)."""
        n = self.num_heads * self.head_dim
        return self.rank * n, (self.rank + 1) * n

    @property
    def kv_rows(self) -> tuple[int, int]:
        """[start, stop) of this rank's rows in k_proj and v_proj."""
        start = self.kv_head_start * self.head_dim
        return start, start + self.num_kv_heads * self.head_dim

    @property
    def mlp_rows(self) -> tuple[int, int]:
        """[start, stop) of this rank's rows in gate/up_proj (and columns of down_proj)."""
        return self.rank * self.intermediate_size, (self.rank + 1) * self.intermediate_size

    @property
    def vocab_rows(self) -> tuple[int, int]:
        """[start, stop) of the real token ids this rank's embedding rows hold; rows past
        ``stop - start`` (at most ``size - 1`` on the last rank) are padding."""
        start = min(self.vocab_size, self.rank * self.vocab_per_rank)
        return start, min(self.vocab_size, start + self.vocab_per_rank)


def size_problems(cfg: ModelConfig, size: int) -> list[str]:
    """Why ``size`` ranks cannot split this model (empty when they can)."""
    problems = []
    heads, kv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    if heads % size:
        problems.append(f"num_attention_heads={heads} is not divisible by it (each rank holds "
                        f"whole query heads)")
    if size <= kv and kv % size:
        problems.append(f"num_key_value_heads={kv} is not divisible by it (each rank holds "
                        f"whole KV heads)")
    if size > kv and size % kv:
        problems.append(f"it is not a multiple of num_key_value_heads={kv} (more ranks than "
                        f"KV heads replicate each KV head on an equal number of ranks)")
    if inter % size:
        problems.append(f"intermediate_size={inter} is not divisible by it")
    return problems


def fitting_sizes(cfg: ModelConfig, limit: int = _LISTED_SIZES) -> list[int]:
    """The tensor-parallel sizes up to ``limit`` this model's shapes split evenly into."""
    return [s for s in range(1, limit + 1) if not size_problems(cfg, s)]


def check_size(cfg: ModelConfig, size: int) -> None:
    """UnsupportedModelError naming each dimension ``size`` does not split, and the sizes
    that would."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    problems = size_problems(cfg, size)
    if problems:
        sizes = ", ".join(map(str, fitting_sizes(cfg)))
        raise UnsupportedModelError(
            f"tensor_parallel_size={size} does not fit this {cfg.architecture}: "
            f"{'; '.join(problems)}. Sizes that fit this model: {sizes}")
