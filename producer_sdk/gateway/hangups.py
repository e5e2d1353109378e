"""A client's hang-up learnt from the kernel, on a thread of its own, not from the event loop.

A streamed answer's job must stop the moment its client leaves (issue #42: within 2 engine
steps at the median, 5 at p99, with 2,000 clients). The event loop learns of a close only
when it polls again and reaches that socket's callback, and with 2,000 streams relaying on a
2-core host one turn of the loop took 150-300 ms in the clients' opening burst: two turns
were 15-30 engine steps of 20 ms. The kernel knows at once: ``EPOLLRDHUP`` fires on a socket
whose peer closed. ``Hangups`` watches the sockets of the streams that asked (their job is
cancelled, not parked, when the client leaves) with one epoll of its own, and runs their
hook on its thread; the hook owes the cancel to ``Cancels``, whose thread sends it. Both
wait only for the GIL (the interpreter's switch interval, 5 ms), whatever the loop does.

The loop's own path (``connection_lost``, guard.py's ``ON_DISCONNECT``) still runs later and
does everything else a leaving client needs; the cancel it owes again is sent at most twice,
and the cancel script is idempotent. Linux only (``select.epoll``): elsewhere ``available``
is False and the loop's path alone cancels.
"""

from __future__ import annotations

import logging
import select
import threading
from typing import Callable, Optional

log = logging.getLogger("tokenrelay.producer_sdk.gateway")

IDLE_EXIT_S = 2.0       # the thread ends this long after the last socket stopped being watched
available = hasattr(select, "epoll") and hasattr(select, "EPOLLRDHUP")


def peer_closed(fd: int) -> bool:
    """Whether the peer of socket ``fd`` has closed (or the socket failed), now."""
    poller = select.poll()
    poller.register(fd, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


class Hangups:
    """Socket fds watched for their peer's hang-up, each with a hook run once from this
    object's thread. ``watch`` and ``unwatch`` are called from the event loop; the thread
    starts with the first watch and ends ``IDLE_EXIT_S`` after the last unwatch."""

    def __init__(self) -> None:
        if not available:
            raise RuntimeError("Hangups needs Linux's epoll (select.EPOLLRDHUP)")
        self._lock = threading.Lock()
        self._hooks: dict[int, Callable[[], None]] = {}
        self._epoll: Optional[select.epoll] = None
        self._thread: Optional[threading.Thread] = None

    def watch(self, fd: int, hook: Callable[[], None]) -> None:
        """Run ``hook`` (from the thread, once) when the peer of socket ``fd`` hangs up. The
        caller unwatches ``fd`` before it closes the socket, so a number the kernel reuses
        never carries an old hook."""
        with self._lock:
            if self._thread is None:
                self._epoll = select.epoll()
                self._thread = threading.Thread(target=self._run, args=(self._epoll,),
                                                name="tokenrelay-hangups", daemon=True)
                self._thread.start()
            assert self._epoll is not None
            flags = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR | select.EPOLLONESHOT
            if fd in self._hooks:
                self._epoll.modify(fd, flags)
            else:
                self._epoll.register(fd, flags)
            self._hooks[fd] = hook

    def unwatch(self, fd: int) -> None:
        """Stop watching ``fd`` (its hook will not run); nothing if it was not watched."""
        with self._lock:
            if self._hooks.pop(fd, None) is not None and self._epoll is not None:
                try:
                    self._epoll.unregister(fd)
                except OSError:         # already closed: the kernel dropped it
                    pass

    @property
    def watched(self) -> int:
        return len(self._hooks)

    def _run(self, epoll: select.epoll) -> None:
        """The thread: run the hook of each socket whose peer hung up; end once nothing was
        watched for ``IDLE_EXIT_S``."""
        while True:
            events = epoll.poll(IDLE_EXIT_S)
            for fd, _ in events:
                with self._lock:
                    hook = self._hooks.pop(fd, None)
                    if hook is not None:
                        epoll.unregister(fd)
                if hook is not None and peer_closed(fd):
                    self._call(hook)
            with self._lock:
                if not events and not self._hooks:
                    self._thread, self._epoll = None, None
                    epoll.close()
                    return

    @staticmethod
    def _call(hook: Callable[[], None]) -> None:
        try:
            hook()
        except Exception:               # a hook's failure must not end the thread
            log.exception("a hang-up hook failed (the loop's disconnect path still runs)")


def socket_fd(transport: object) -> Optional[int]:
    """The fd of an asyncio transport's socket (None without one)."""
    sock = getattr(transport, "get_extra_info", lambda _name: None)("socket")
    fd = sock.fileno() if sock is not None else -1
    return fd if fd >= 0 else None


__all__ = ["Hangups", "available", "peer_closed", "socket_fd"]
