"""A user's mistake ends a command with one clear line and a non-zero exit, never a traceback
(#18): Redis unreachable or refusing the password, a model path that is not a checkpoint, a hub
id, a mistyped flag, missing batch files, a batch file with no valid line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.fixtures_redis import REPO_ROOT

pytestmark = pytest.mark.timeout(120)
DOWN = "redis://127.0.0.1:1/0"          # nothing listens on port 1


def run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os
    return subprocess.run([sys.executable, "-m", "tokenrelay", *argv], cwd=str(REPO_ROOT), text=True,
                          capture_output=True, timeout=90, env={**os.environ, **(env or {})})


def assert_clean(out: subprocess.CompletedProcess, code: int, *words: str) -> None:
    text = out.stdout + out.stderr
    assert out.returncode == code, (out.returncode, text[-2000:])
    assert "Traceback" not in text, text[-2000:]
    for w in words:
        assert w in text, (w, text[-2000:])


@pytest.mark.parametrize("argv, code, words", [
    (("admin", "--redis-url", DOWN, "workers"), 3, ("cannot reach Redis",)),
    (("admin", "--redis-url", DOWN, "dead", "list"), 3, ("cannot reach Redis",)),
    (("health", "--redis-url", DOWN, "--worker-id", "w"), 1, ("unreachable",)),
    (("stats", "--redis-url", DOWN), 3, ("cannot reach Redis",)),
    (("status", "j1", "--redis-url", DOWN), 3, ("cannot reach Redis",)),
], ids=lambda v: " ".join(v) if isinstance(v, tuple) and len(v) > 2 else None)
def test_redis_unreachable(argv, code, words):
    assert_clean(run(*argv), code, *words)


def test_wrong_password_for_admin_is_a_configuration_error(redis_server):
    redis_server.client().config_set("requirepass", "right")
    url = f"redis://:wrong@127.0.0.1:{redis_server.port}/0"
    out = run("admin", "--redis-url", url, "pending")
    assert_clean(out, 78, "redis configuration error")
    assert "wrong" not in out.stderr                     # the password is never printed


@pytest.mark.parametrize("model, words", [
    ("/nonexistent/checkpoint", ("no config.json",)),
    ("Qwen/Qwen3-8B", ("hub id", "never downloads", "--local-dir")),
])
def test_a_model_that_cannot_be_loaded_is_one_line_and_exit_78(model, words):
    out = run("worker", "--model", model, "--device", "cpu", "--redis-url", DOWN)
    assert_clean(out, 78, *words)
    errors = [json.loads(x) for x in out.stderr.splitlines() + out.stdout.splitlines()
              if x.startswith("{") and json.loads(x).get("level") == "error"]
    assert len(errors) == 1 and errors[0]["exit_code"] == 78, errors   # the log says the code


def test_a_mistyped_setting_names_the_flag_and_its_variable():
    assert_clean(run("worker", "--model", "fake:", "--max-num-seqs", "abc"), 2,
                 "--max-num-seqs / TOKENRELAY_MAX_NUM_SEQS", "'abc'")
    assert_clean(run("worker", "--model", "fake:", env={"TOKENRELAY_BLOCK_MS": "soon"}), 2,
                 "--block-ms / TOKENRELAY_BLOCK_MS")


def test_batch_files(tmp_path, redis_server):
    url = ("--redis-url", redis_server.url)
    assert_clean(run("batch", str(tmp_path / "missing.jsonl"),
                     str(tmp_path / "out.jsonl"), *url), 2, "does not exist")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"custom_id": "a"}\nnot json\n')
    assert_clean(run("batch", str(bad), str(tmp_path / "no" / "out.jsonl"),
                     *url), 2, "create it first")
    assert_clean(run("batch", str(bad), str(tmp_path / "out.jsonl"),
                     "--no-progress", *url), 2, "no line of")


def test_the_producer_cli_honours_tokenrelay_namespace(redis_server):
    out = run("status", "nobody", "--redis-url", redis_server.url, "--json",
              env={"TOKENRELAY_NAMESPACE": "tenant-x"})
    assert out.returncode == 6 and json.loads(out.stdout)["state"] == "unknown"
    from tokenrelay.producer_sdk import Client
    with Client(redis_server.url, namespace="tenant-x") as c:
        c.submit("hi", job_id="in-x")
    out = run("status", "in-x", "--redis-url", redis_server.url,
              env={"TOKENRELAY_NAMESPACE": "tenant-x"})
    assert out.returncode == 0 and out.stdout.split()[:2] == ["in-x", "queued"], out


@pytest.mark.parametrize("argv", [
    ("admin", "--redis-url", "URL", "--json", "workers"),
    ("admin", "workers", "--redis-url", "URL", "--json"),
    ("admin", "--redis-url", "redis://127.0.0.1:1/0", "workers", "--redis-url", "URL",
     "--json"),
    ("--redis-url", "URL", "status", "x", "--json"),
    ("status", "x", "--redis-url", "URL", "--json"),
])
def test_connection_flags_go_before_or_after_the_subcommand(redis_server, argv):
    """The value nearest the end wins, as with any flag given twice."""
    out = run(*[redis_server.url if a == "URL" else a for a in argv])
    assert out.returncode in (0, 6), out.stderr
    json.loads(out.stdout)


def test_worker_help_lists_admin_and_says_what_each_default_is():
    out = run("worker", "--help")
    assert out.returncode == 0 and "tokenrelay admin" in out.stdout
    assert "default None" not in out.stdout and "default: none, required" in out.stdout


@pytest.mark.parametrize("url, words", [
    ("localhost:6379", ("bad --redis-url localhost:6379", "redis://")),
    ("redis://127.0.0.1:notaport/0", ("bad --redis-url", "notaport")),
    ("redis://:wrong@REDIS/0", ("redis configuration error", "password")),
    ("redis://other:pw@REDIS/0", ("redis configuration error", "NoPermissionError")),
], ids=["no-scheme", "bad-port", "wrong-password", "acl-other-namespace"])
def test_redis_is_checked_before_the_model_loads(redis_server, url, words):
    """A Redis URL that can never work ends the worker before its model loads (a model path
    that does not exist would be the next error: it is never reached), one line, exit 78."""
    with redis_server.client() as r:
        r.acl_setuser("other", enabled=True, passwords=["+pw"], keys=["other:*"],
                      commands=["+@all"])
        r.config_set("requirepass", "right")
    out = run("worker", "--model", "/nonexistent/checkpoint", "--device", "cpu",
              "--redis-url", url.replace("REDIS", f"127.0.0.1:{redis_server.port}"))
    assert_clean(out, 78, *words)
    assert "no config.json" not in out.stdout + out.stderr
    assert "wrong" not in out.stderr and ":pw@" not in out.stderr


def test_an_unreachable_redis_is_waited_for_after_loading_the_model():
    """Not a configuration error: Redis may be starting. The worker warns at once, loads its
    model (here: fails to, which ends it with the model's error), then would retry."""
    out = run("worker", "--model", "/nonexistent/checkpoint", "--device", "cpu",
              "--redis-url", DOWN)
    assert_clean(out, 78, "redis not reachable yet", "no config.json")
