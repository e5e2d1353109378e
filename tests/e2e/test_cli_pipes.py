"""Every command line, piped into a reader that has gone away (``| head``), ends quietly with
141 (what a shell reports for SIGPIPE) instead of a BrokenPipeError traceback (#18)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.fixtures_redis import REPO_ROOT

pytestmark = pytest.mark.timeout(60)

COMMANDS = [     # URL stands for the test's redis-server
    ("admin", "--redis-url", "URL", "workers"),
    ("admin", "--redis-url", "URL", "dead", "list"),
    ("admin", "--redis-url", "URL", "--json", "pending"),
    ("stats", "--redis-url", "URL"),
]


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_a_closed_stdout_ends_the_command_quietly(redis_server, argv):
    argv = [redis_server.url if a == "URL" else a for a in argv]
    proc = subprocess.Popen([sys.executable, "-m", "tokenrelay", *argv], cwd=str(REPO_ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()                     # the reader is gone before the first line
    _, err = proc.communicate(timeout=50)
    text = err.decode(errors="replace")
    assert "Traceback" not in text and "BrokenPipe" not in text, text
    assert proc.returncode == 141, (proc.returncode, text)


def test_output_that_fits_still_exits_zero(redis_server):
    out = subprocess.run([sys.executable, "-m", "tokenrelay", "admin", "--redis-url",
                          redis_server.url, "workers"], cwd=str(REPO_ROOT), capture_output=True,
                         timeout=50)
    assert out.returncode == 0 and out.stdout.startswith(b"worker_id"), out
