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

Sooner still, a stream whose job is cancelled when its client leaves hands a hook to the
request state's ``WATCH_HANGUP``: the connection's socket is then watched by ``Hangups``
(gateway/hangups.py), whose thread runs the hook the moment the kernel sees the peer close,
whatever turn the loop is in. The socket is unwatched in ``connection_lost``, before asyncio
closes it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenrelay.producer_sdk.gateway.guard import ON_DISCONNECT, WATCH_HANGUP
from tokenrelay.producer_sdk.gateway.hangups import Hangups, available, socket_fd
from tokenrelay.producer_sdk.gateway.settings import GatewaySettings

log = logging.getLogger("tokenrelay.producer_sdk.gateway")


class HeaderDeadline(H11Protocol):
    """h11 with a deadline on each request's headers (``header_timeout_s``)."""

    header_timeout_s = 10.0
    hangups: Optional[Hangups] = None   # None: no hang-up watch (not Linux)

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self._headers_timer: Optional[Any] = None
        self._fd = socket_fd(transport)
        self._hangup: Optional[tuple[Any, Callable[[], None]]] = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        if self._headers_timer is None and (before is None or before.response_complete):
            self._arm()                 # the first bytes of a kept-alive connection's next one
        super().data_received(data)
        if self.cycle is not before:    # a request's headers arrived whole
            self._disarm()
            if self.cycle is not None and self.hangups is not None and self._fd is not None:
                self.cycle.scope.setdefault("state", {})[WATCH_HANGUP] = self._watch_hangup

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._disarm()
        if self._hangup is not None:
            self._hangup = None
            self.hangups.unwatch(self._fd)  # type: ignore[union-attr]  # set with _hangup
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and not cycle.response_complete:
            hook = cycle.scope.get("state", {}).pop(ON_DISCONNECT, None)
            if hook is not None:
                hook()

    def _watch_hangup(self, hook: Callable[[], None]) -> None:
        """The request being answered wants ``hook`` run, from the watcher's thread, if its
        client hangs up before its response completes."""
        self._hangup = (self.cycle, hook)
        self.hangups.watch(self._fd, self._hung_up)     # type: ignore[union-attr, arg-type]

    def _hung_up(self) -> None:
        """The watcher's thread: the peer closed; run the hook of the request it was for, if
        that request is still being answered."""
        pending, self._hangup = self._hangup, None
        if pending is not None and pending[0] is self.cycle and \
                not pending[0].response_complete:
            pending[1]()

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
    """The protocol class of one server: its header deadline and its own hang-up watcher."""
    watcher = Hangups() if available else None
    return type("HeaderDeadlineProtocol", (HeaderDeadline,),
                {"header_timeout_s": header_timeout_s, "hangups": watcher})


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
