"""A streamed answer's disconnect hook runs in the server's ``connection_lost`` (gateway/http.py),
not a turn of the event loop later in the request's task: at 2,000 streams a turn of the
gateway's loop took up to 95 ms, engine steps its job ran on for nobody (issue #42)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tokenrelay.producer_sdk.gateway.guard import ON_DISCONNECT
from tokenrelay.producer_sdk.gateway.settings import GatewaySettings
from tests.fault_harness import wait_for
from tests.fixtures_redis import free_port
from tests.gateway.helpers import raw_stream, serve

pytestmark = pytest.mark.timeout(60)


class StreamingApp:
    """Sends headers and one chunk, sets a hook, then reads until the client's disconnect:
    records where each run of the hook came from and whether it ran before that read."""

    def __init__(self) -> None:
        self.hook_runs: list[str] = []
        self.ran_before_read: list[bool] = []

    def hook(self) -> None:
        self.hook_runs.append("task" if asyncio.current_task() else "callback")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        scope.setdefault("state", {})[ON_DISCONNECT] = self.hook
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b": hello\n\n", "more_body": True})
        while (await receive())["type"] != "http.disconnect":
            pass
        self.ran_before_read.append(bool(self.hook_runs))


def test_the_hook_runs_once_from_connection_lost() -> None:
    app = StreamingApp()
    gateway = serve(app, GatewaySettings(port=free_port()))
    try:
        raw_stream(gateway.server.config.port, until=b"hello").close()
        wait_for(lambda: app.ran_before_read, timeout=20, what="the disconnect read")
        assert app.hook_runs == ["callback"] and app.ran_before_read == [True]
    finally:
        gateway.stop()
