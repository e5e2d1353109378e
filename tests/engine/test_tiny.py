"""engine.tiny writes real, deterministic Hugging Face checkpoints that transformers loads."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tokenrelay.engine import tiny

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_same_arguments_give_same_bytes(tmp_path):
    a = tiny.write_checkpoint(tmp_path / "a", "qwen3", seed=3, shards=2)
    b = tiny.write_checkpoint(tmp_path / "b", "qwen3", seed=3, shards=2)
    assert _files(a) == _files(b)
    c = tiny.write_checkpoint(tmp_path / "c", "qwen3", seed=4, shards=2)
    assert _files(c)["tokenizer.json"] == _files(a)["tokenizer.json"]
    assert _files(c)["model-00001-of-00002.safetensors"] != _files(a)["model-00001-of-00002.safetensors"]


def test_cli_writes_checkpoint(tmp_path, capsys):
    tiny.main([str(tmp_path / "m"), "--arch", "mistral", "--seed", "1", "--dtype", "bfloat16",
               "--rope-scaling", "linear", "--shards", "2", "--tie"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is True
    assert cfg["rope_scaling"]["rope_type"] == "linear"
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00002.safetensors",
                                                 "model-00002-of-00002.safetensors"}
    with safe_open(str(tmp_path / "m" / "model-00001-of-00002.safetensors"), "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_in_transformers(tiny_checkpoint, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_checkpoint(arch)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    assert type(model).__name__ == HF_CLASSES[arch]
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == [HF_CLASSES[arch]] and cfg["model_type"] == arch
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    params = dict(model.named_parameters())
    assert ("model.layers.0.self_attn.q_proj.bias" in params) == (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in params) == (arch == "qwen3")
    tok = AutoTokenizer.from_pretrained(str(path))
    assert len(tok) == cfg["vocab_size"]
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.convert_tokens_to_ids("</s>"),
                                   tok.convert_tokens_to_ids("<|im_end|>")]


def test_tied_and_untied_embeddings(tiny_checkpoint):
    for arch, tied in (("qwen3", True), ("llama", False)):
        path = tiny_checkpoint(arch)
        assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is tied
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            assert ("lm_head.weight" in f.keys()) is not tied


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_tokenizer_agrees_with_tokenizer_json(tiny_checkpoint, arch):
    """transformers 5 rebuilds some tokenizers (qwen2) from vocab/merges; ids must not change."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = tiny_checkpoint(arch)
    text = tiny.CORPUS.read_text(encoding="utf-8")[:3000]
    raw = Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids
    assert AutoTokenizer.from_pretrained(str(path))(text).input_ids == raw


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chat_template_and_round_trips(tiny_checkpoint, arch):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_checkpoint(arch)))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                        "<|im_start|>user\n你好<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(rendered, add_special_tokens=False).input_ids
    assert tok.convert_tokens_to_ids("<|im_start|>") in ids
    for text in ["北京是中国的首都。", "def f(x):\n    return x ** 2  # 😀", " leading  spaces\t"]:
        ids = tok(text, add_special_tokens=False).input_ids
        assert tok.decode(ids) == text
    with_bos = tok("hi").input_ids[0] == tok.bos_token_id
    assert with_bos == (arch == "llama")


@pytest.mark.parametrize("arch", ARCHS)
def test_next_token_distribution_is_peaked(tiny_checkpoint, arch):
    """Greedy parity needs clear winners: top-1 far above uniform, no near-ties."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_checkpoint(arch)
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ids = tok(tiny.CORPUS.read_text(encoding="utf-8")[:400], return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0]
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3
    assert logits.softmax(-1).max(-1).values.mean() > 50 / logits.shape[-1]


def test_bench_size_shape():
    cfg = tiny.make_config("qwen3", size="bench")
    weights = tiny.make_weights({**cfg, "num_hidden_layers": 1}, seed=0)
    per_layer = sum(t.numel() for n, t in weights.items() if ".layers." in n)
    total = per_layer * cfg["num_hidden_layers"] + cfg["vocab_size"] * cfg["hidden_size"]
    assert 35e6 < total < 50e6
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["vocab_size"]) == (512, 8, 4, 64, 32000)


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="llama"):
        tiny.write_checkpoint(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="llama3"):
        tiny.write_checkpoint(tmp_path, rope_scaling="yarn")
