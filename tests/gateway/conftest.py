"""Fixtures of the gateway tests."""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

from tests.gateway.helpers import Gateway, start_gateway


@pytest.fixture
def gateway_factory() -> Iterator[Callable[..., Gateway]]:
    """``gateway_factory(redis_url, **settings)``; every gateway is stopped at teardown."""
    started: list[Gateway] = []

    def make(redis_url: str, **settings: Any) -> Gateway:
        gw = start_gateway(redis_url, **settings)
        started.append(gw)
        return gw

    try:
        yield make
    finally:
        for gw in started:
            gw.server.should_exit = True
        for gw in started:
            gw.thread.join(timeout=15)
