"""worker/connection.py: every Redis error is classified once (transient: wait it out;
permanent: exit 78 with one line; other: the caller ends that job alone), and the backoff."""

from __future__ import annotations

import pytest
import redis

from tokenrelay.protocol.topology import ClusterModeError
from tokenrelay.worker.connection import Backoff, ErrorKind, classify, classify_text, describe_permanent


@pytest.mark.parametrize("exc,kind", [
    (redis.ConnectionError("reset"), ErrorKind.TRANSIENT),
    (redis.exceptions.OutOfMemoryError("command not allowed"), ErrorKind.TRANSIENT),
    (redis.ResponseError("LOADING Redis is loading the dataset"), ErrorKind.TRANSIENT),
    (redis.ResponseError("CLUSTERDOWN The cluster is down"), ErrorKind.TRANSIENT),
    (redis.AuthenticationError("invalid password"), ErrorKind.PERMANENT),
    (redis.ResponseError("WRONGPASS invalid username-password pair"), ErrorKind.PERMANENT),
    (redis.ResponseError("NOPERM this user has no permissions"), ErrorKind.PERMANENT),
    # protected mode: redis-py raises the reply as an error, or as a lost connection when the
    # server closes it right after
    (redis.ResponseError("DENIED Redis is running in protected mode because protected mode is "
                         "enabled"), ErrorKind.PERMANENT),
    (redis.ConnectionError("DENIED Redis is running in protected mode"), ErrorKind.PERMANENT),
    (ClusterModeError("cluster mode is not enabled"), ErrorKind.PERMANENT),
    (redis.ResponseError("WRONGTYPE Operation against a key"), ErrorKind.OTHER),
    (ValueError("not redis at all"), ErrorKind.OTHER),
])
def test_classify(exc, kind):
    assert classify(exc) is kind


def test_a_scripts_error_text_is_classified_like_the_error():
    assert classify_text("OOM command not allowed when used memory > 'maxmemory'") \
        is ErrorKind.TRANSIENT
    assert classify_text("error in script: -OOM command not allowed") is ErrorKind.TRANSIENT
    assert classify_text("-NOPERM no permissions") is ErrorKind.PERMANENT
    assert classify_text("WRONGTYPE Operation") is ErrorKind.OTHER


def test_a_permanent_error_is_one_line_without_the_password():
    line = describe_permanent(redis.AuthenticationError("invalid password"),
                              "redis://worker:s3cret@host:6379/0")
    assert "s3cret" not in line and "worker:***@host" in line and "\n" not in line
    assert "--cluster" in describe_permanent(ClusterModeError("no"), "redis://h:1/0")


def test_backoff_grows_pauses_and_resets():
    b = Backoff(first_s=0.01, max_s=0.05)
    delays = [b.failed() for _ in range(6)]
    assert all(0.005 <= d <= 0.075 for d in delays) and b.failures == 6
    assert b.paused and b.remaining() > 0
    assert b.succeeded() is True and not b.paused and b.failures == 0
    assert b.succeeded() is False                  # nothing to recover from


def test_protected_mode_says_what_to_change():
    line = describe_permanent(redis.ConnectionError("DENIED Redis is running in protected mode"),
                              "redis://:secret@10.0.0.5:6379/0")
    assert "protected mode" in line and "requirepass" in line and "secret" not in line


class _Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def warning(self, event: str, **fields: object) -> None:
        self.lines.append(event)


def test_a_restart_is_noticed_by_the_run_id_without_an_error(redis_server):
    """The pooled client reconnects silently after the restart; only the run id tells."""
    from tokenrelay.worker.connection import ServerRestarts
    client = redis_server.client()
    restarts = ServerRestarts(client, _Log())
    assert restarts.restarted() is False               # the first read sets the baseline
    assert restarts.restarted() is False
    redis_server.restart()
    assert restarts.restarted() is True
    assert restarts.restarted() is False
    client.close()


def test_a_user_without_info_turns_the_check_off_once(redis_server):
    from tokenrelay.worker.connection import ServerRestarts
    admin = redis_server.client()
    admin.acl_setuser("noinfo", enabled=True, passwords=["+pw"], keys=["*"],
                      commands=["+@all", "-info"])
    client = redis.Redis(port=redis_server.port, username="noinfo", password="pw")
    log = _Log()
    restarts = ServerRestarts(client, log)
    assert restarts.restarted() is False and restarts.restarted() is False
    assert not restarts.enabled and len(log.lines) == 1 and "+info" in log.lines[0]
    client.close()
    admin.close()
