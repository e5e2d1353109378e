"""Tensor parallelism without processes: which sizes a model allows (and the messages that
refuse the others), what each rank holds and reads of a checkpoint, the step's wire form, and
the worker flag. The multi-process tests are in test_tensor_parallel.py."""

from __future__ import annotations

import json

import pytest
import torch

from tokenrelay.engine.config import EngineConfig
from tokenrelay.engine.errors import UnsupportedModelError
from tokenrelay.engine.model_config import ModelConfig
from tokenrelay.engine.layers.tensor_parallel import SKIP, Slice, checkpoint_slice
from tokenrelay.engine.parallel.partition import Partition, check_size, fitting_sizes

# SmolLM2-135M-Instruct's shapes (engine.fetch builds it): 9 query heads over 3 KV heads.
SMOLLM2 = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=49152,
               hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               max_position_embeddings=8192, tie_word_embeddings=True, hidden_act="silu")
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=1001,
            hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=2048)


def cfg(**overrides) -> ModelConfig:
    return ModelConfig.from_dict({**TINY, **overrides})


def test_smollm2_size_2_is_refused_naming_the_dimension_and_the_sizes_that_fit():
    smol = ModelConfig.from_dict(SMOLLM2)
    with pytest.raises(UnsupportedModelError) as err:
        check_size(smol, 2)
    msg = str(err.value)
    assert "tensor_parallel_size=2" in msg and "num_attention_heads=9" in msg
    assert "num_key_value_heads=3" in msg
    assert "Sizes that fit this model: 1, 3" in msg
    assert fitting_sizes(smol) == [1, 3]       # 9 would leave 1536 / 9 MLP columns
    part = Partition.of(smol, 2, 3)
    assert (part.num_heads, part.num_kv_heads, part.kv_head_start) == (3, 1, 2)
    assert part.intermediate_size == 512 and part.vocab_per_rank == 16384


def test_engine_config_refuses_before_anything_starts(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    with pytest.raises(UnsupportedModelError, match="num_attention_heads=9"):
        EngineConfig(model=str(tmp_path), device="cpu", tensor_parallel_size=2).resolve()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            EngineConfig(model=str(tmp_path), device="cpu", tensor_parallel_size=bad).resolve()
    with pytest.raises(ValueError, match="tensor_parallel_timeout"):
        EngineConfig(model=str(tmp_path), device="cpu", tensor_parallel_size=3,
                     tensor_parallel_timeout=0).resolve()


def test_other_dimensions_are_named():
    with pytest.raises(UnsupportedModelError, match="intermediate_size=250 is not divisible"):
        check_size(cfg(intermediate_size=250), 4)
    with pytest.raises(UnsupportedModelError, match="multiple of num_key_value_heads=2"):
        check_size(cfg(num_attention_heads=6, num_key_value_heads=2, intermediate_size=258), 3)


def test_kv_heads_are_replicated_when_ranks_outnumber_them():
    c = cfg()                              # 4 query heads over 2 KV heads
    parts = [Partition.of(c, r, 4) for r in range(4)]
    assert [p.num_heads for p in parts] == [1, 1, 1, 1]
    assert [p.num_kv_heads for p in parts] == [1, 1, 1, 1]
    assert [p.kv_head_start for p in parts] == [0, 0, 1, 1]
    group = c.num_attention_heads // c.num_key_value_heads
    for p in parts:                        # every query head of a rank reads the KV head it holds
        first_q = p.q_rows[0] // p.head_dim
        heads = range(first_q, first_q + p.num_heads)
        assert {h // group for h in heads} == {p.kv_head_start}
    halves = [Partition.of(c, r, 2) for r in range(2)]
    assert [(p.num_kv_heads, p.kv_rows) for p in halves] == [(1, (0, 32)), (1, (32, 64))]


def test_vocabulary_is_padded_and_the_padding_is_never_a_real_id():
    parts = [Partition.of(cfg(), r, 2) for r in range(2)]     # 1001 ids
    assert [p.vocab_per_rank for p in parts] == [501, 501]
    assert [p.vocab_rows for p in parts] == [(0, 501), (501, 1001)]   # rank 1: 1 padding row
    assert checkpoint_slice("model.embed_tokens.weight", None, parts[1]) == Slice(
        0, 501, 1001, padded=True)


def test_each_rank_reads_its_slice_of_every_split_tensor():
    r0, r1 = (Partition.of(cfg(), r, 2) for r in range(2))
    layer = "model.layers.0."
    assert checkpoint_slice(layer + "self_attn.qkv_proj.weight", 0, r1) == Slice(0, 64, 128)
    assert checkpoint_slice(layer + "self_attn.qkv_proj.bias", 2, r1) == Slice(0, 32, 64)
    assert checkpoint_slice(layer + "self_attn.o_proj.weight", None, r1) == Slice(1, 64, 128)
    assert checkpoint_slice(layer + "mlp.gate_up_proj.weight", 1, r0) == Slice(0, 0, 128)
    assert checkpoint_slice(layer + "mlp.down_proj.weight", None, r1) == Slice(1, 128, 256)
    # The row-parallel bias is added once: rank 0 reads it whole, the others skip it.
    assert checkpoint_slice(layer + "self_attn.o_proj.bias", None, r0) is None
    assert checkpoint_slice(layer + "self_attn.o_proj.bias", None, r1) == SKIP
    assert checkpoint_slice(layer + "input_layernorm.weight", None, r1) is None
    whole = Partition.of(cfg())
    assert checkpoint_slice(layer + "self_attn.o_proj.weight", None, whole) is None


def test_kv_block_bytes_are_per_rank(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "vocab_size": 1024}))
    one = EngineConfig(model=str(tmp_path), device="cpu").resolve()
    two = EngineConfig(model=str(tmp_path), device="cpu", tensor_parallel_size=2).resolve()
    four = EngineConfig(model=str(tmp_path), device="cpu", tensor_parallel_size=4).resolve()
    assert two.kv_block_bytes() * 2 == one.kv_block_bytes()
    assert four.kv_block_bytes() == two.kv_block_bytes()        # one replicated KV head each


def test_a_step_crosses_as_two_tensors_and_comes_back_equal():
    from tokenrelay.engine.step_inputs import StepInputs
    from tokenrelay.engine.parallel.step import HEADER_LEN, pack, payload_len, unpack
    step = StepInputs(
        input_ids=torch.tensor([5, 6, 7, 8]), positions=torch.tensor([0, 1, 2, 9]),
        slot_mapping=torch.tensor([32, 33, 34, 57]),
        block_tables=torch.tensor([[2, 0], [1, 3]], dtype=torch.int32),
        seq_lens=torch.tensor([3, 10], dtype=torch.int32),
        context_lens=torch.tensor([0, 9], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 3, 4], dtype=torch.int32),
        logits_indices=torch.tensor([2, 3]), block_copies=torch.tensor([[1, 3]]),
        max_seqlen_q=3, max_seqlen_k=10, is_decode=False)
    header, payload = pack(step)
    assert header.shape == (HEADER_LEN,) and header.dtype == payload.dtype == torch.int64
    assert payload_len(header) == payload.numel()
    back = unpack(header, payload)
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens",
                 "context_lens", "cu_seqlens_q", "logits_indices", "block_copies"):
        got, want = getattr(back, name), getattr(step, name)
        assert got.dtype == want.dtype and torch.equal(got, want), name
    assert (back.max_seqlen_q, back.max_seqlen_k, back.is_decode) == (3, 10, False)


def test_worker_flag_reaches_the_engine_only_when_set(monkeypatch):
    from tokenrelay.protocol.settings import settings_from_args
    from tokenrelay.worker.config import build_parser

    monkeypatch.delenv("TOKENRELAY_TENSOR_PARALLEL_SIZE", raising=False)
    base = settings_from_args(build_parser().parse_args(["--model", "m"])).engine_kwargs()
    assert "tensor_parallel_size" not in base
    two = settings_from_args(build_parser().parse_args(
        ["--model", "m", "--tensor-parallel-size", "2"])).engine_kwargs()
    assert two["tensor_parallel_size"] == 2
    monkeypatch.setenv("TOKENRELAY_TENSOR_PARALLEL_SIZE", "4")
    env = settings_from_args(build_parser().parse_args(["--model", "m"])).engine_kwargs()
    assert env["tensor_parallel_size"] == 4
