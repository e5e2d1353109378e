"""``tokenrelay COMMAND``: one command line over every package's entry point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.import_boundaries import ROOT
from tokenrelay.cli import COMMANDS, main


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenrelay", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("worker", "health", "admin", "submit", "batch", "status", "result", "cancel",
                 "stats", "gateway", "fetch", "tiny"):
        assert f"  {name} " in out
    assert set(COMMANDS) >= {"worker", "gateway", "fetch", "submit"}


def test_no_command_and_an_unknown_one_are_usage_errors(capsys):
    assert main([]) == 2
    assert main(["serve-all"]) == 2
    assert "unknown command 'serve-all'" in capsys.readouterr().err


@pytest.mark.parametrize("command, expect", [
    ("worker", "--model"), ("admin", "dead"), ("submit", "prompt"), ("batch", "input"),
    ("gateway", "--api-keys"), ("fetch", "smollm2")])
def test_each_command_reaches_its_own_parser(command, expect):
    done = run(command, "--help")
    assert done.returncode == 0, done.stderr
    assert expect in done.stdout
    assert f"tokenrelay {command}" in done.stdout.splitlines()[0] or "usage: tokenrelay" in done.stdout


def test_the_console_script_is_installed_and_producer_commands_load_no_torch():
    script = Path(sys.executable).parent / "tokenrelay"
    assert script.is_file(), "pip install -e . installs the tokenrelay console script"
    code = ("import sys; from tokenrelay.cli import main\n"
            "for c in ('submit', 'batch', 'status', 'stats', 'cancel', 'result', 'gateway'):\n"
            "    try: main([c, '--help'])\n"
            "    except SystemExit: pass\n"
            "assert 'torch' not in sys.modules, 'a producer command imported torch'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    version = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert version.stdout.startswith("tokenrelay ")


def test_exit_codes_pass_through():
    """A command's own exit code is the tokenrelay command's (submit with a bad URL: 2)."""
    done = run("submit", "hi", "--redis-url", "not-a-url")
    assert done.returncode == 2, (done.returncode, done.stderr)
