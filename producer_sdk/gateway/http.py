"""The gateway's HTTP server: uvicorn, with a deadline on a request's headers, and a request's
disconnect hook run the moment its connection is lost.

uvicorn's h11 protocol waits for a request's headers as long as a client cares to dribble
them (a connection that sends nothing at all stays open too): a few hundred slow clients
(slowloris) hold the gateway's sockets and memory forever. ``HeaderDeadline`` closes a
connection whose request headers are not complete ``header_timeout_s`` after it opened, or
after the first byte of its next request; slow bodies are the ASGI guard's
(``producer_sdk/gateway/guard.py``).

A streamed answer's ``ON_DISCONNECT`` hook (guard.py: its feed's close, which cancels or parks
its job) runs in ``connection_lost`` itself, not a turn of the event loop later when the
request's task wakes to read the disconnect: at 2,000 streams on a 2-core host that turn took
12 ms at the median and 95 ms at p99, up to 5 engine steps (issue #42). The guard's own hook
call stays for servers other than this one; the hook is popped, so it runs once.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenrelay.producer_sdk.gateway.guard import ON_DISCONNECT
from tokenrelay.producer_sdk.gateway.settings import GatewaySettings

log = logging.getLogger("tokenrelay.producer_sdk.gateway")


class HeaderDeadline(H11Protocol):
    """h11 with a deadline on each request's headers (``header_timeout_s``)."""

    header_timeout_s = 10.0

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self._headers_timer: Optional[Any] = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        if self._headers_timer is None and (before is None or before.response_complete):
            self._arm()                 # the first bytes of a kept-alive connection's next one
        super().data_received(data)
        if self.cycle is not before:    # a request's headers arrived whole
            self._disarm()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and not cycle.response_complete:
            hook = cycle.scope.get("state", {}).pop(ON_DISCONNECT, None)
            if hook is not None:
                hook()

    def _arm(self) -> None:
        self._disarm()
        self._headers_timer = self.loop.call_later(self.header_timeout_s, self._too_slow)

    def _disarm(self) -> None:
        if self._headers_timer is not None:
            self._headers_timer.cancel()
            self._headers_timer = None

    def _too_slow(self) -> None:
        self._headers_timer = None
        if self.cycle is None or self.cycle.response_complete:
            log.info("closing a connection whose request headers took over %s s",
                     self.header_timeout_s)
            self.transport.close()


def protocol(header_timeout_s: float) -> type[HeaderDeadline]:
    return type("HeaderDeadlineProtocol", (HeaderDeadline,),
                {"header_timeout_s": header_timeout_s})


def server_config(app: Any, settings: GatewaySettings, **overrides: Any) -> uvicorn.Config:
    """uvicorn's settings for ``app``: the header deadline, keep-alive, graceful stop."""
    options: dict[str, Any] = dict(host=settings.host, port=settings.port,
                                   log_level=settings.log_level, lifespan="on",
                                   http=protocol(settings.header_timeout_s),
                                   timeout_keep_alive=5, timeout_graceful_shutdown=5,
                                   access_log=False)    # the app's own line: access_log.py
    options.update(overrides)
    return uvicorn.Config(app, **options)


__all__ = ["HeaderDeadline", "protocol", "server_config"]
