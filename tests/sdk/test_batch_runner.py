"""OpenAI-format batch runner: mapping, output format, malformed lines, kill-and-resume."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokenrelay.producer_sdk import Client
from tokenrelay.producer_sdk.batch.runner import BatchRunner, DoneIndex, LineError, job_id_for
from tokenrelay.producer_sdk.cli.exit_codes import EXIT_FAILED
from tokenrelay.producer_sdk.openai.format import body_to_request
from tests.sdk_helpers import FakeWorker, env_with_repo, sdk_redis, sdk_url  # noqa: F401


def chat_line(i: int, **body) -> str:
    return json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "tiny", "messages": [{"role": "user", "content": f"q{i}"}],
                                "max_tokens": 3, **body}})


def completion_line(i: int, max_tokens: int = 2) -> str:
    return json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "tiny", "prompt": f"p{i}",
                                "max_completion_tokens": max_tokens,
                                "temperature": 0, "stop": ["\n"], "seed": 3, "n": 1}})


def write_input(path: Path, n: int, malformed_at: dict[int, str], max_tokens: int = 0) -> None:
    """Alternating completion/chat lines (3 and 2 tokens, or ``max_tokens`` for both)."""
    lines = []
    for i in range(n):
        if i in malformed_at:
            lines.append(malformed_at[i])
        elif i % 2:
            lines.append(chat_line(i, max_tokens=max_tokens) if max_tokens else chat_line(i))
        else:
            lines.append(completion_line(i, max_tokens or 2))
    path.write_text("\n".join(lines) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_body_mapping():
    chat = body_to_request("/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 5, "temperature": 0.5, "top_p": 0.9, "stop": "x", "seed": 1,
        "n": 1, "logprobs": True, "top_logprobs": 2, "user": "u"})
    assert chat == {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                    "logprobs": 2, "n": 1, "temperature": 0.5, "top_p": 0.9, "stop": "x",
                    "seed": 1}
    assert body_to_request("/v1/completions", {"prompt": "x", "n": 3})["n"] == 3
    assert body_to_request("/v1/completions", {"prompt": [[1, 2]]}) == {"prompt_token_ids": [1, 2]}
    qwen3 = body_to_request("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": {"enable_thinking": False}})
    assert qwen3["chat_template_kwargs"] == {"enable_thinking": False}
    for url, body, code in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "foo": 1},
         "unsupported_field"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "best_of": 2},
         "unsupported_field"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "invalid_request"),
        ("/v1/embeddings", {"input": "x"}, "invalid_url"),
        ("/v1/completions", {"prompt": "x", "chat_template_kwargs": {"a": 1}}, "invalid_request"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                  "chat_template_kwargs": "yes"}, "invalid_request"),
    ]:
        with pytest.raises(LineError) as err:
            body_to_request(url, body)
        assert err.value.code == code


def test_done_index_repairs_a_cut_line(tmp_path: Path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"custom_id": "a"}\n{"custom_id": "b"}\n{"custom_id": "c", "resp')
    idx = DoneIndex.load(out, tmp_path / "missing.jsonl")
    assert "a" in idx and "b" in idx and "c" not in idx and len(idx) == 2
    assert out.read_text().endswith('"b"}\n')


def test_batch_200_lines_with_3_malformed(sdk_url: str, tmp_path: Path):
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    write_input(inp, 200, {
        10: "{not json",
        50: json.dumps({"custom_id": "req-50", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"messages": [{"role": "user", "content": "x"}], "bogus": 1}}),
        120: chat_line(120, temperature=-3),  # passes mapping, fails SamplingParams
    })
    with FakeWorker(sdk_url), Client(sdk_url) as client:
        summary = BatchRunner(client, inp, out, err, batch_id="t200", concurrency=32,
                              progress=False).run()
    assert (summary.succeeded, summary.malformed, summary.failed) == (197, 3, 0)
    outputs, errors = read_jsonl(out), read_jsonl(err)
    assert len(outputs) == 197 and len(errors) == 3
    assert sorted(e["error"]["line"] for e in errors) == [11, 51, 121]
    assert {e["error"]["code"] for e in errors} == {"invalid_json", "unsupported_field",
                                                     "invalid_request"}
    chat = next(o for o in outputs if o["custom_id"] == "req-1")
    body = chat["response"]["body"]
    assert chat["error"] is None and chat["response"]["status_code"] == 200
    assert chat["response"]["request_id"] == job_id_for("t200", "req-1")
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": " t0 t1 t2"}
    assert body["usage"]["completion_tokens"] == 3 and body["usage"]["total_tokens"] >= 3
    comp = next(o for o in outputs if o["custom_id"] == "req-0")["response"]["body"]
    assert comp["object"] == "text_completion" and comp["choices"][0]["text"] == " t0 t1"
    from openai.types import Completion
    from openai.types.chat import ChatCompletion
    for o in outputs:           # every body is what the openai package itself would parse
        body = o["response"]["body"]
        model = ChatCompletion if body["object"] == "chat.completion" else Completion
        parsed = model.model_validate(body, strict=True)
        usage = parsed.usage
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # A rerun has nothing left to do and writes nothing twice.
    with Client(sdk_url) as client:
        again = BatchRunner(client, inp, out, err, batch_id="t200", progress=False).run()
    assert again.skipped == 200 and len(read_jsonl(out)) == 197 and len(read_jsonl(err)) == 3


def test_duplicate_custom_id_is_an_error_line_and_answered_once(sdk_url: str, tmp_path: Path):
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    write_input(inp, 6, {4: completion_line(2)})  # line 5 repeats req-2
    with FakeWorker(sdk_url), Client(sdk_url) as client:
        summary = BatchRunner(client, inp, out, err, batch_id="dups", progress=False).run()
        assert (summary.succeeded, summary.malformed) == (5, 1)
        again = BatchRunner(client, inp, out, err, batch_id="dups", progress=False).run()
    outputs, errors = read_jsonl(out), read_jsonl(err)
    assert sorted(o["custom_id"] for o in outputs) == [f"req-{i}" for i in (0, 1, 2, 3, 5)]
    assert [(e["error"]["line"], e["custom_id"], e["error"]["code"]) for e in errors] == [
        (5, None, "duplicate_custom_id")]
    assert again.skipped == 6 and len(read_jsonl(out)) == 5 and len(read_jsonl(err)) == 1


def run_cli_batch(sdk_url: str, inp: Path, out: Path, err: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tokenrelay.producer_sdk", "batch", str(inp), str(out), "--errors", str(err),
         "--concurrency", "16", "--batch-id", "killme", "--redis-url", sdk_url, "--no-progress"],
        env=env_with_repo(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_batch_killed_halfway_then_resumed(sdk_url: str, tmp_path: Path):
    inp, out, err = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    write_input(inp, 200, {7: "[]", 99: "oops", 150: chat_line(150, best_of=3)})
    worker = FakeWorker(sdk_url, token_delay=0.004)
    worker.start()
    proc = run_cli_batch(sdk_url, inp, out, err)
    try:
        deadline = time.monotonic() + 60
        while len(read_jsonl(out)) < 60:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        first = len(read_jsonl(out))
        assert first < 197, "the batch finished before it could be killed"
        proc = run_cli_batch(sdk_url, inp, out, err)
        stdout, stderr = proc.communicate(timeout=120)
        # the malformed lines are in the errors file: the run says so with its exit code
        assert proc.returncode == EXIT_FAILED, stderr.decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        worker.stop()
    ids = [o["custom_id"] for o in read_jsonl(out)] + [e["custom_id"] for e in read_jsonl(err)]
    named = [i for i in ids if i is not None]
    assert len(named) == len(set(named)), "a custom_id was written twice"
    assert set(named) | {"req-7", "req-99"} == {f"req-{i}" for i in range(200)}
    assert len(read_jsonl(err)) == 3
    # Jobs in flight at the kill were reattached, not run a second time.
    assert len(worker.processed) == len(set(worker.processed)) == 197
    summary = json.loads(next(line for line in stderr.decode().splitlines()
                              if line.startswith("{")))
    assert summary["errors_file_lines"] == 3
    assert summary["skipped"] >= first


def test_chat_template_kwargs_are_validated_before_enqueue():
    from tokenrelay.producer_sdk.errors import InvalidRequest
    from tokenrelay.producer_sdk.jobs.payloads import PayloadBuilder
    from tokenrelay.protocol.keys import Keys
    from tokenrelay.protocol.wire import decode_job
    builder = PayloadBuilder(Keys())
    msgs = [{"role": "user", "content": "hi"}]
    job = decode_job(builder.build(messages=msgs, chat_template_kwargs={"enable_thinking": False},
                                   max_tokens=3).payload)
    assert job.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(InvalidRequest, match="chat_template_kwargs"):
        builder.build("a prompt", chat_template_kwargs={"enable_thinking": False})
    with pytest.raises(InvalidRequest, match="chat_template_kwargs"):
        builder.build(messages=msgs, chat_template_kwargs={"pad": "x" * 70_000})
    with pytest.raises(InvalidRequest, match="add_generation_prompt"):
        builder.build(messages=msgs, chat_template_kwargs={"add_generation_prompt": False})
