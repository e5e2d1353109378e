"""Write small, random-weight Hugging Face checkpoints for tests and benchmarks.

``python -m tokenrelay.engine.tiny OUT --arch {llama,qwen2,qwen3,mistral} [--seed N] [--size {tiny,bench,1b}]``

Nothing can be downloaded here, so tests need real checkpoints made locally: config.json,
safetensors weights under HF names, generation_config.json, and a byte-level BPE tokenizer
trained on ``engine/data/corpus.txt`` with a ChatML chat template. Output is a pure function
of the arguments (same bytes twice). Weights are scaled so next-token distributions are peaked
(top-1 well above uniform, top1-top2 logit gaps far above float rounding), which keeps greedy
parity tests from flipping on ties.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
from pathlib import Path

import torch
from safetensors.torch import save_file

ARCHS = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=10000.0,
                  tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                  pretraining_tp=1),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1000000.0,
                  tie_word_embeddings=True, use_sliding_window=False, sliding_window=None,
                  max_window_layers=0),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rope_theta=1000000.0,
                  tie_word_embeddings=True, attention_bias=False, use_sliding_window=False,
                  sliding_window=None, max_window_layers=0),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral",
                    rope_theta=1000000.0, tie_word_embeddings=False, sliding_window=None),
}
SIZES = {
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 max_position_embeddings=2048),
    "bench": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                  max_position_embeddings=4096),
    # TinyLlama-1.1B's shape: the GPU check's engine figures (write it with dtype="bfloat16":
    # 2.2 GB, seconds on a GPU machine, so no checkpoint has to travel there).
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4, head_dim=64,
               max_position_embeddings=2048),
}
ROPE_SCALINGS = {
    "none": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    # original_max_position_embeddings is small so tiny head dims hit all three frequency bands.
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

PAD, BOS, EOS, IM_START, IM_END = "<|pad|>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]     # ids 0..4
PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(5)
ADDS_BOS = {"llama", "mistral"}     # like the real tokenizers: Llama/Mistral prepend <s>
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# A ChatML template that renders tools in the Hermes format (the Qwen2.5 family's): function
# signatures as JSON lines within <tools></tools> in the system turn, calls answered as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>, results as <tool_response> turns.
# Tests of tool calls use it (``--chat-template tools``); random weights never write a call by
# themselves, so those tests constrain the answer into the format.
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n"
    "Function signatures, one JSON object per line, within <tools></tools> tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nTo call a function, answer with a JSON object holding its name "
    "and arguments within <tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- set skip_first = messages[0]['role'] == 'system' %}"
    "{%- else %}{%- set skip_first = false %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if loop.first and skip_first %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call.get('function') else call %}"
    "{%- set args = fn['arguments'] if fn['arguments'] is string else fn['arguments'] | tojson %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + args"
    " + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHAT_TEMPLATES = {"chatml": CHAT_TEMPLATE, "tools": TOOLS_CHAT_TEMPLATE}
QWEN_PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                          r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = Path(__file__).parent / "data" / "corpus.txt"


def _pseudo_words(count: int) -> list[str]:
    """Deterministic made-up words; they give BPE enough distinct pairs to learn a 32k vocab
    from a corpus of a few KB (the bundled text alone stops far earlier)."""
    rng = random.Random(1234)
    onsets = ["", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t",
              "v", "w", "z", "st", "tr", "pl", "ch", "sh", "th", "br", "gr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
    codas = ["", "", "", "n", "r", "s", "t", "l", "m", "ng"]
    syllables = [o + v + c for o in onsets for v in vowels for c in codas]
    words = []
    for _ in range(count):
        word = "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
        words.append(word.capitalize() if rng.random() < 0.1 else word)
    return [" ".join(words[i:i + 12]) for i in range(0, len(words), 12)]


@functools.lru_cache(maxsize=4)
def trained_tokenizer_json(vocab_size: int) -> str:
    """Train (once per process and size) a byte-level BPE tokenizer; returns its JSON.

    Cached because training is the slow part of making a checkpoint."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    lines = CORPUS.read_text(encoding="utf-8").splitlines()
    if vocab_size > 4096:
        lines += _pseudo_words(vocab_size * 3)
    tok.train_from_iterator(lines, trainer)
    return tok.to_str()


def build_tokenizer_json(arch: str, vocab_size: int) -> str:
    """The trained tokenizer dressed per family: BOS post-processor for Llama/Mistral; Qwen's
    NFC + digit-splitting pre-tokenizer for Qwen (transformers 5 rebuilds qwen2 tokenizers with
    exactly that pipeline, so tokenizer.json must agree with it)."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, processors

    tok = Tokenizer.from_str(trained_tokenizer_json(vocab_size))
    if arch.startswith("qwen"):
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if arch in ADDS_BOS:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)])
    return tok.to_str(pretty=True)


def make_config(arch: str, size: str = "tiny", rope_scaling: str = "none",
                dtype: str = "float32", tie_word_embeddings: bool | None = None,
                attention_bias: bool = False, vocab_size: int | None = None) -> dict:
    """config.json contents, in the classic (transformers 4.x) layout real checkpoints use.
    ``attention_bias`` (Llama, Mistral, Qwen3): biases on q/k/v and o_proj; ``vocab_size``
    overrides the size's (an odd one exercises tensor-parallel vocabulary padding)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {', '.join(SIZES)}")
    if rope_scaling not in ROPE_SCALINGS:
        raise ValueError(f"unknown rope scaling {rope_scaling!r}; choose from {', '.join(ROPE_SCALINGS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    cfg = dict(ARCHS[arch])
    cfg.update(SIZES[size])
    if tie_word_embeddings is not None:
        cfg["tie_word_embeddings"] = tie_word_embeddings
    if attention_bias:
        if arch == "qwen2":
            raise ValueError("qwen2 always has q/k/v biases and never an o_proj bias")
        cfg["attention_bias"] = True
    if vocab_size is not None:
        cfg["vocab_size"] = vocab_size
    qwen = arch.startswith("qwen")
    cfg.update(hidden_act="silu", rms_norm_eps=1e-6, initializer_range=0.02, use_cache=True,
               attention_dropout=0.0, bos_token_id=BOS_ID,
               eos_token_id=IM_END_ID if qwen else EOS_ID, pad_token_id=PAD_ID,
               rope_scaling=ROPE_SCALINGS[rope_scaling], torch_dtype=dtype)
    return cfg


def make_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random float32 weights under HF names, drawn in a fixed order from one generator."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    def norm_weight(n: int) -> torch.Tensor:
        return 1.0 + normal(n, std=0.1)

    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    tied = cfg["tie_word_embeddings"]
    # Logit std ~ head_std * sqrt(h) = 4: peaked distributions, well-separated top tokens.
    head_std = 4.0 / math.sqrt(h)
    w = {"model.embed_tokens.weight": normal(vocab, h, std=head_std if tied else 1.0)}
    qkv_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm_weight(h)
        for name, rows in (("q_proj", hq * d), ("k_proj", hkv * d), ("v_proj", hkv * d)):
            w[p + f"self_attn.{name}.weight"] = normal(rows, h, std=1.0 / math.sqrt(h))
            if qkv_bias:
                w[p + f"self_attn.{name}.bias"] = normal(rows, std=0.1)
        w[p + "self_attn.o_proj.weight"] = normal(h, hq * d, std=1.0 / math.sqrt(hq * d))
        if cfg.get("attention_bias", False):        # Llama/Mistral/Qwen3: o_proj too
            w[p + "self_attn.o_proj.bias"] = normal(h, std=0.1)
        if cfg["model_type"] == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm_weight(d)
            w[p + "self_attn.k_norm.weight"] = norm_weight(d)
        w[p + "post_attention_layernorm.weight"] = norm_weight(h)
        w[p + "mlp.gate_proj.weight"] = normal(inter, h, std=1.0 / math.sqrt(h))
        w[p + "mlp.up_proj.weight"] = normal(inter, h, std=1.0 / math.sqrt(h))
        w[p + "mlp.down_proj.weight"] = normal(h, inter, std=0.5 / math.sqrt(inter))
    w["model.norm.weight"] = norm_weight(h)
    if not tied:
        w["lm_head.weight"] = normal(vocab, h, std=head_std)
    return w


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _save_weights(out: Path, weights: dict[str, torch.Tensor], shards: int) -> None:
    meta = {"format": "pt"}
    if shards <= 1:
        save_file(weights, str(out / "model.safetensors"), metadata=meta)
        return
    names = list(weights)
    per = math.ceil(len(names) / shards)
    weight_map, total = {}, 0
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[k * per:(k + 1) * per]}
        save_file(part, str(out / fname), metadata=meta)
        for n, t in part.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    _write_json(out / "model.safetensors.index.json",
                {"metadata": {"total_size": total}, "weight_map": weight_map})


def write_checkpoint(out: str | Path, arch: str = "llama", seed: int = 0, size: str = "tiny",
                     shards: int = 1, rope_scaling: str = "none", dtype: str = "float32",
                     tie_word_embeddings: bool | None = None, attention_bias: bool = False,
                     vocab_size: int | None = None, chat_template: str = "chatml") -> Path:
    """Write a complete HF checkpoint folder at ``out`` and return its path (options: see
    :func:`make_config`). ``chat_template``: ``chatml`` (plain), or ``tools`` (renders tools,
    Hermes calls)."""
    if chat_template not in CHAT_TEMPLATES:
        raise ValueError(f"chat_template must be one of {sorted(CHAT_TEMPLATES)}, got "
                         f"{chat_template!r}")
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = make_config(arch, size, rope_scaling, dtype, tie_word_embeddings, attention_bias,
                      vocab_size)
    weights = {n: t.to(DTYPES[dtype]).contiguous()
               for n, t in make_weights(cfg, seed).items()}
    _save_weights(out, weights, shards)
    _write_json(out / "config.json", cfg)
    _write_json(out / "generation_config.json",
                {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID],
                 "pad_token_id": PAD_ID})
    (out / "tokenizer.json").write_text(build_tokenizer_json(arch, cfg["vocab_size"]),
                                        encoding="utf-8")
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": IM_END if arch.startswith("qwen") else EOS,
        "pad_token": PAD, "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": cfg["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATES[chat_template],
    })
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tokenrelay.engine.tiny", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="output folder (created)")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--rope-scaling", choices=list(ROPE_SCALINGS), default="none")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32")
    parser.add_argument("--chat-template", choices=sorted(CHAT_TEMPLATES), default="chatml",
                        help="tools: a template that renders tools (Hermes <tool_call> format)")
    tie = parser.add_mutually_exclusive_group()
    tie.add_argument("--tie", dest="tie", action="store_true", default=None,
                     help="force tie_word_embeddings=true (default: per arch)")
    tie.add_argument("--no-tie", dest="tie", action="store_false")
    args = parser.parse_args(argv)
    path = write_checkpoint(args.out, args.arch, args.seed, args.size, args.shards,
                            args.rope_scaling, args.dtype, args.tie, args.chat_template)
    print(path)


if __name__ == "__main__":
    main()
