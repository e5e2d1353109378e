"""engine.loader / engine.model_config: formats we read, and clear errors for what we do not."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tokenrelay.engine.errors import UnsupportedModelError
from tokenrelay.engine.loader import load_model, load_tokenizer
from tokenrelay.engine.model_config import ModelConfig, RopeScaling


def _copy(src, tmp_path, edit=None):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    if edit is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_sharded_equals_single(tiny_checkpoint):
    single = load_model(tiny_checkpoint("qwen2", seed=5))
    sharded = load_model(tiny_checkpoint("qwen2", seed=5, shards=3))
    a, b = dict(single.named_parameters()), dict(sharded.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_fused_projections_hold_hf_rows(tiny_checkpoint):
    from safetensors import safe_open

    path = tiny_checkpoint("llama")
    model = load_model(path)
    attn = model.model.layers[1].self_attn
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        q, k, v = (f.get_tensor(f"model.layers.1.self_attn.{n}_proj.weight") for n in "qkv")
        up = f.get_tensor("model.layers.1.mlp.up_proj.weight")
    assert torch.equal(attn.qkv_proj.weight, torch.cat([q, k, v]))
    assert torch.equal(model.model.layers[1].mlp.gate_up_proj.weight[-up.shape[0]:], up)


def test_dtype_auto_and_override(tiny_checkpoint):
    path = tiny_checkpoint("llama", dtype="bfloat16")
    assert load_model(path).lm_head.weight.dtype == torch.bfloat16
    model = load_model(path, dtype="float32")
    assert model.lm_head.weight.dtype == torch.float32
    assert model.cos_sin_cache.dtype == torch.float32
    with pytest.raises(UnsupportedModelError, match="float16"):
        load_model(path, dtype="int8")


def test_tied_model_shares_embedding(tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen3"))
    assert model.lm_head is None
    assert model.lm_head_weight is model.model.embed_tokens.weight


def test_unsupported_architecture(tiny_checkpoint, tmp_path):
    def edit(cfg):
        cfg["architectures"] = ["GPT2LMHeadModel"]
        cfg["model_type"] = "gpt2"

    path = _copy(tiny_checkpoint("llama"), tmp_path, edit)
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*Qwen3ForCausalLM"):
        load_model(path)


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 4.0},
                                  {"type": "dynamic", "factor": 2.0}])
def test_unsupported_rope_type(tiny_checkpoint, tmp_path, rope):
    path = _copy(tiny_checkpoint("llama"), tmp_path, lambda cfg: cfg.update(rope_scaling=rope))
    with pytest.raises(UnsupportedModelError, match="rope type .* supported: default, linear, llama3"):
        load_model(path)


def test_rope_config_spellings():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=8, hidden_size=8,
                intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    legacy = ModelConfig.from_dict({**base, "rope_theta": 5e5,
                                    "rope_scaling": {"type": "linear", "factor": 2}})
    assert legacy.rope_theta == 5e5 and legacy.rope_scaling == RopeScaling("linear", 2.0)
    v5 = ModelConfig.from_dict({**base, "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 5e5, "factor": 8, "low_freq_factor": 1,
        "high_freq_factor": 4, "original_max_position_embeddings": 8192}})
    assert v5.rope_theta == 5e5 and v5.rope_scaling.original_max_position_embeddings == 8192
    plain = ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "default",
                                                               "rope_theta": 1e4}})
    assert plain.rope_scaling is None and plain.head_dim == 4 and plain.num_key_value_heads == 2
    with pytest.raises(UnsupportedModelError, match="low_freq_factor"):
        ModelConfig.from_dict({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8}})


def test_config_switches_and_eos(tiny_checkpoint):
    q2 = ModelConfig.from_pretrained(tiny_checkpoint("qwen2"))
    q3 = ModelConfig.from_pretrained(tiny_checkpoint("qwen3"))
    ll = ModelConfig.from_pretrained(tiny_checkpoint("mistral"))
    assert (q2.family, q2.qkv_bias, q2.qk_norm) == ("qwen2", True, False)
    assert (q3.family, q3.qkv_bias, q3.qk_norm, q3.tie_word_embeddings) == ("qwen3", False, True, True)
    assert (ll.family, ll.qkv_bias, ll.sliding_window) == ("mistral", False, None)
    assert q3.eos_token_ids == [4, 2]   # config.json's <|im_end|>, then generation_config's </s>


def test_missing_files_are_explained(tiny_checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    path = _copy(tiny_checkpoint("llama"), tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(path)
    (path / "tokenizer.json").unlink()
    (path / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_tokenizer(path)


def test_missing_shard_and_missing_tensor(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _copy(tiny_checkpoint("llama", shards=2), tmp_path)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="00002"):
        load_model(path)
    single = tmp_path / "single"
    shutil.copytree(tiny_checkpoint("llama"), single)
    tensors = load_file(str(single / "model.safetensors"))
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, str(single / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="lacks weights.*qkv_proj"):
        load_model(single)


def test_shape_mismatch_is_reported(tiny_checkpoint, tmp_path):
    path = _copy(tiny_checkpoint("llama"), tmp_path, lambda cfg: cfg.update(intermediate_size=128))
    with pytest.raises(UnsupportedModelError, match=r"mlp\..*has shape .* config.json implies"):
        load_model(path)


def test_load_tokenizer(tiny_checkpoint):
    tok = load_tokenizer(tiny_checkpoint("qwen3"))
    assert tok.decode(tok("你好 world").input_ids) == "你好 world"
