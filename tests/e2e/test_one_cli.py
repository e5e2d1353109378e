"""One settings and CLI layer (#18, protocol/settings.py) for the four commands:
``tokenrelay worker``, ``tokenrelay health``, ``tokenrelay admin`` and
``tokenrelay``. Every option is a field of a pydantic-settings model, a flag and a
``TOKENRELAY_<NAME>`` variable; flags beat env vars beat defaults; --help shows every default;
connection flags go before or after the subcommand."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Callable, Iterator

import pytest
from pydantic import Field

from tokenrelay.producer_sdk.cli import main as producer_cli
from tokenrelay.protocol import settings as cli_common
from tokenrelay.protocol.settings import CliSettings, env_of, flag_of, parse_settings, unset
from tokenrelay.protocol.keys import Keys
from tokenrelay.protocol.wire import now_ms
from tests.fixtures_redis import REPO_ROOT
from tokenrelay.worker import admin
from tokenrelay.worker import config as worker_config

pytestmark = pytest.mark.timeout(120)

# Options that are not settings: they say *what* to act on, like the positional ids, and an
# environment variable must never choose it (TOKENRELAY_ALL=1 would purge every dead letter).
NOT_SETTINGS = {"--help", "--all"}

PARSERS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "tokenrelay worker": worker_config.build_parser,
    "tokenrelay admin": admin.build_parser,
    "tokenrelay": producer_cli.build_parser,
}

# Per command: argv with a subcommand (flags appended after it), the settings field that a
# TOKENRELAY_* variable and a flag set, and the values to give. Connection flags after the
# subcommand are covered by the namespace cases.
CASES = {
    "worker": (worker_config.build_parser, ["--model", "m"], "max_num_seqs", "7", "9", 9),
    "health": (worker_config.build_parser, ["health"], "heartbeat_ms", "300", "400", 400),
    "admin": (worker_config.build_parser, ["admin", "workers"], "json", "true", "--no-json",
              False),
    "producer": (producer_cli.build_parser, ["submit", "hi"], "max_tokens", "5", "6", 6),
}


@pytest.fixture(autouse=True)
def _no_tokenrelay_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith(cli_common.ENV_PREFIX)]:
        monkeypatch.delenv(name)


def walk(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser`` and every subcommand parser below it."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from walk(sub)


def settings_parsers() -> Iterator[tuple[str, argparse.ArgumentParser, type[CliSettings]]]:
    for top in PARSERS.values():
        for p in walk(top()):
            model = p.get_default(cli_common._MODEL)
            if model is not None:
                yield p.prog, p, model


def parse(build: Callable[[], argparse.ArgumentParser], argv: list[str]) -> CliSettings:
    return parse_settings(build(), argv)[1]


# ------------------------------------------------------------------------------------------
# derived from the models
# ------------------------------------------------------------------------------------------

def test_every_settings_field_is_a_flag_and_every_flag_a_field():
    """Fails when a field has no flag or a flag is built by hand beside the model."""
    seen = 0
    for prog, parser, model in settings_parsers():
        flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--")}
        fields = {flag_of(name) for name in model.model_fields}
        negations = {"--no-" + f[2:] for f in fields}
        assert fields <= flags, (prog, fields - flags)
        assert flags - fields - negations <= NOT_SETTINGS, (prog, flags - fields - negations)
        seen += 1
    assert seen >= 15, seen      # worker, health, admin's levels, producer's six commands


def test_help_shows_every_default_and_variable_and_never_none():
    for prog, parser, model in settings_parsers():
        text = " ".join(parser.format_help().split())
        assert "None" not in text, prog
        for name in model.model_fields:
            assert f"[env {env_of(name, model)}; default: " in text, (prog, name)


def test_a_field_that_defaults_to_none_must_say_what_that_means():
    class Vague(CliSettings):
        limit: int | None = None

    class Clear(CliSettings):
        limit: int | None = Field(None, json_schema_extra=unset("no limit"))

    with pytest.raises(TypeError, match="limit"):
        cli_common.add_settings_flags(argparse.ArgumentParser(), Vague)
    p = argparse.ArgumentParser()
    cli_common.add_settings_flags(p, Clear)
    assert "default: no limit" in p.format_help()


# ------------------------------------------------------------------------------------------
# precedence, per command
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=str)
def test_env_var_takes_effect_and_a_flag_beats_it(case, monkeypatch):
    build, argv, name, env_value, flag_value, expected = CASES[case]
    default = parse(build, argv)
    monkeypatch.setenv(env_of(name), env_value)
    from_env = parse(build, argv)
    assert getattr(from_env, name) != getattr(default, name)
    assert str(getattr(from_env, name)).lower() == env_value
    flag = [flag_value] if flag_value.startswith("--") else [flag_of(name), flag_value]
    assert getattr(parse(build, [*argv, *flag]), name) == expected


@pytest.mark.parametrize("case", CASES, ids=str)
def test_tokenrelay_namespace_and_the_flag_on_either_side_of_the_subcommand(case, monkeypatch):
    build, argv, *_ = CASES[case]
    monkeypatch.setenv("TOKENRELAY_NAMESPACE", "from-env")
    assert parse(build, argv).namespace == "from-env"
    assert parse(build, [*argv, "--namespace", "after"]).namespace == "after"
    assert parse(build, ["--namespace", "before", *argv]).namespace == "before"
    assert parse(build, ["--namespace", "before", *argv, "--namespace", "last"]).namespace == "last"


def test_a_flag_of_another_command_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        parse(worker_config.build_parser, ["--max-num-seqs", "3", "health"])
    assert exc.value.code == 2
    assert "--max-num-seqs does not apply" in capsys.readouterr().err


@pytest.mark.parametrize("build, argv, flag", [
    (worker_config.build_parser, ["health", "--heartbeat-ms", "soon"], "--heartbeat-ms"),
    (worker_config.build_parser, ["admin", "dead", "list", "--count", "x"], "--count"),
    (producer_cli.build_parser, ["batch", "in", "out", "--concurrency", "many"], "--concurrency"),
    (producer_cli.build_parser, ["status", "x", "--queue", "a:b"], "--queue"),
])
def test_a_mistyped_value_names_the_flag_and_its_variable(build, argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        parse(build, argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert f"{flag} / TOKENRELAY_{flag[2:].replace('-', '_').upper()}" in err


def test_stats_reports_every_queue_unless_one_is_given(monkeypatch):
    assert parse(producer_cli.build_parser, ["stats"]).queue is None
    assert parse(producer_cli.build_parser, ["stats", "--queue", "q"]).queue == "q"
    monkeypatch.setenv("TOKENRELAY_QUEUE", "envq")
    assert parse(producer_cli.build_parser, ["stats"]).queue == "envq"


def test_repeatable_options_take_a_json_list_from_the_environment(monkeypatch):
    monkeypatch.setenv("TOKENRELAY_STOP", '["a", "b"]')
    assert parse(producer_cli.build_parser, ["submit", "x"]).stop == ["a", "b"]
    assert parse(producer_cli.build_parser, ["submit", "x", "--stop", "c"]).stop == ["c"]


# ------------------------------------------------------------------------------------------
# the commands as a user runs them
# ------------------------------------------------------------------------------------------

def run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(cli_common.ENV_PREFIX)}
    return subprocess.run([sys.executable, "-m", "tokenrelay", *argv], cwd=str(REPO_ROOT), text=True,
                          capture_output=True, timeout=90, env={**clean, **(env or {})})


@pytest.mark.parametrize("argv", [("worker",), ("health",), ("admin",),
                                  ("admin", "dead", "list"), ("stats",),
                                  ("submit",)], ids=" ".join)
def test_help_of_each_command(argv):
    out = run(*argv, "--help")
    assert out.returncode == 0, out.stderr
    assert "TOKENRELAY_NAMESPACE" in out.stdout and "default: tokenrelay" in out.stdout
    assert "None" not in out.stdout


def beat(r, keys: Keys, worker_id: str) -> None:
    r.hset(keys.heartbeat(worker_id), mapping={"ts": now_ms(), "engine_loaded": 1})
    r.zadd(keys.workers, {worker_id: now_ms()})


def test_health_and_admin_read_tokenrelay_variables_and_flags_win(redis_server):
    r, keys = redis_server.client(), Keys("tenant-h")
    beat(r, keys, "w-h")
    env = {"TOKENRELAY_REDIS_URL": redis_server.url, "TOKENRELAY_NAMESPACE": "tenant-h",
           "TOKENRELAY_WORKER_ID": "w-h", "TOKENRELAY_HEARTBEAT_MS": "60000"}
    assert run("health", env=env).returncode == 0
    other = {**env, "TOKENRELAY_NAMESPACE": "elsewhere"}
    assert run("health", env=other).returncode == 1
    assert run("health", "--namespace", "tenant-h", env=other).returncode == 0
    assert run("worker", "--namespace", "tenant-h", "health", env=other).returncode == 0
    listed = run("admin", "workers", env={**env, "TOKENRELAY_JSON": "true"})
    assert [w["worker_id"] for w in json.loads(listed.stdout)] == ["w-h"], listed.stderr
    table = run("admin", "workers", "--no-json", env={**env, "TOKENRELAY_JSON": "1"})
    assert table.stdout.startswith("worker_id"), table.stderr
    after = run("admin", "workers", "--namespace", "tenant-h", "--json", env=other)
    assert [w["worker_id"] for w in json.loads(after.stdout)] == ["w-h"], after.stderr


def test_the_producer_cli_reads_its_options_from_the_environment(redis_server):
    env = {"TOKENRELAY_REDIS_URL": redis_server.url, "TOKENRELAY_JSON": "true"}
    out = run("status", "nobody", env=env)
    assert out.returncode == 6 and json.loads(out.stdout)["state"] == "unknown", out.stderr
    line = run("status", "nobody", "--no-json", env=env)
    assert line.returncode == 6 and line.stdout.split()[:2] == ["nobody", "unknown"]


def test_the_worker_reads_tokenrelay_variables_and_flags_win(redis_server, worker_process):
    wp = worker_process("--model", "fake:", "--namespace", "tenant-w", "--heartbeat-ms", "200",
                        "--block-ms", "50",
                        env={"TOKENRELAY_REDIS_URL": redis_server.url,
                             "TOKENRELAY_NAMESPACE": "not-this", "TOKENRELAY_WORKER_ID": "w-env"})
    wp.wait_for_log('"worker ready"', 60)
    r = redis_server.client()
    assert r.exists(Keys("tenant-w").heartbeat("w-env"))
    assert not r.keys("not-this:*")
    wp.terminate()
    assert wp.wait(30) == 0


def test_a_command_own_setting_has_its_own_variable(monkeypatch):
    """``priority`` means submit's (0) or batch's (1): TOKENRELAY_PRIORITY, the old shared
    name, sets neither; each command's own variable sets its own only (#40)."""
    build = producer_cli.build_parser
    monkeypatch.setenv("TOKENRELAY_PRIORITY", "3")
    assert parse(build, ["submit", "hi"]).priority == 0
    assert parse(build, ["batch", "in", "out"]).priority == 1
    monkeypatch.setenv("TOKENRELAY_BATCH_PRIORITY", "5")
    assert parse(build, ["submit", "hi"]).priority == 0
    assert parse(build, ["batch", "in", "out"]).priority == 5
    assert parse(build, ["batch", "in", "out", "--priority", "2"]).priority == 2
    monkeypatch.setenv("TOKENRELAY_MODEL", "/models/smollm2")     # the worker's checkpoint
    assert parse(build, ["submit", "hi"]).model is None
    monkeypatch.setenv("TOKENRELAY_SUBMIT_MODEL", "smollm2")
    assert parse(build, ["submit", "hi"]).model == "smollm2"
    monkeypatch.setenv("TOKENRELAY_SUBMIT_PRIORITY", "x")
    with pytest.raises(SystemExit):
        parse(build, ["submit", "hi"])
