"""A client's hang-up seen by the kernel runs its stream's hook from the watcher's thread
(gateway/hangups.py), even while the event loop is stuck in a long turn: with 2,000 streams a
turn took 150-300 ms in the opening burst, 15-30 engine steps before a cancel (issue #42)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import pytest

from tokenrelay.producer_sdk.gateway import hangups
from tokenrelay.producer_sdk.gateway.guard import ON_DISCONNECT, WATCH_HANGUP
from tokenrelay.producer_sdk.gateway.hangups import Hangups, peer_closed
from tokenrelay.producer_sdk.gateway.settings import GatewaySettings
from tests.fault_harness import wait_for
from tests.fixtures_redis import free_port
from tests.gateway.helpers import raw_stream, serve

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not hangups.available, reason="needs Linux's epoll")]


def test_a_peer_that_closes_runs_the_hook_once_from_the_watchers_thread() -> None:
    watcher = Hangups()
    ours, peer = socket.socketpair()
    ran: list[str] = []
    try:
        watcher.watch(ours.fileno(), lambda: ran.append(threading.current_thread().name))
        peer.sendall(b"data is not a hang-up")
        time.sleep(0.2)
        assert ran == [] and not peer_closed(ours.fileno())
        peer.close()
        wait_for(lambda: ran, timeout=5, what="the hook")
        time.sleep(0.1)
        assert ran == ["tokenrelay-hangups"] and watcher.watched == 0
    finally:
        ours.close()


def test_an_unwatched_socket_runs_nothing_and_the_thread_ends_when_idle(monkeypatch) -> None:
    monkeypatch.setattr(hangups, "IDLE_EXIT_S", 0.2)
    watcher = Hangups()
    ours, peer = socket.socketpair()
    ran: list[bool] = []
    try:
        watcher.watch(ours.fileno(), lambda: ran.append(True))
        thread = watcher._thread
        assert thread is not None and thread.is_alive()
        watcher.unwatch(ours.fileno())
        watcher.unwatch(ours.fileno())              # twice: nothing
        peer.close()
        thread.join(5)
        assert not thread.is_alive() and ran == [] and watcher._thread is None
        other, other_peer = socket.socketpair()     # a later watch starts a new thread
        watcher.watch(other.fileno(), lambda: ran.append(True))
        other_peer.close()
        wait_for(lambda: ran, timeout=5, what="the second thread's hook")
        other.close()
    finally:
        ours.close()


def test_a_failing_hook_leaves_the_watcher_running() -> None:
    watcher = Hangups()
    pairs = [socket.socketpair() for _ in range(2)]
    ran: list[int] = []

    def broken() -> None:
        raise RuntimeError("hook exploded")
    try:
        watcher.watch(pairs[0][0].fileno(), broken)
        pairs[0][1].close()
        time.sleep(0.2)
        watcher.watch(pairs[1][0].fileno(), lambda: ran.append(1))
        pairs[1][1].close()
        wait_for(lambda: ran, timeout=5, what="the hook after a failing one")
    finally:
        for ours, peer in pairs:
            ours.close()
            peer.close()


class StuckLoopApp:
    """Sends headers and one chunk, asks for a hang-up hook, then blocks the event loop for
    ``STUCK_S`` (a long turn), then reads until the client's disconnect. Records when the
    hang-up hook and the loop's disconnect hook ran, and from which thread."""

    STUCK_S = 1.5

    def __init__(self) -> None:
        self.runs: list[tuple[str, str, float]] = []
        self.stuck = threading.Event()          # set as the loop gets stuck
        self.stuck_until = 0.0

    def ran(self, which: str) -> Any:
        return lambda: self.runs.append((which, threading.current_thread().name,
                                         time.monotonic()))

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        state = scope.setdefault("state", {})
        state[ON_DISCONNECT] = self.ran("disconnect")
        state[WATCH_HANGUP](self.ran("hangup"))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b": hello\n\n", "more_body": True})
        await asyncio.sleep(0.1)
        self.stuck.set()                        # the client leaves now
        time.sleep(self.STUCK_S)                # the loop is stuck: no turn notices the close
        self.stuck_until = time.monotonic()
        while (await receive())["type"] != "http.disconnect":
            pass


def test_a_hang_up_is_acted_on_while_the_loop_is_stuck() -> None:
    app = StuckLoopApp()
    gateway = serve(app, GatewaySettings(port=free_port()))
    try:
        with raw_stream(gateway.server.config.port, until=b"hello"):
            assert app.stuck.wait(10)           # leave while the loop is stuck
        wait_for(lambda: len(app.runs) == 2, timeout=20, what="both hooks")
        (first, first_thread, first_at), (second, _, second_at) = app.runs
        assert (first, first_thread) == ("hangup", "tokenrelay-hangups")
        assert first_at < app.stuck_until, "the hang-up waited for the stuck loop"
        assert second == "disconnect" and second_at >= app.stuck_until
    finally:
        gateway.stop()
