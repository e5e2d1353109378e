"""The gateway's Prometheus metrics (``GET /metrics``), in a registry of its own so several
gateways in one process (tests) never collide."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("tokenrelay_gateway_requests", "HTTP requests answered",
                                ("endpoint", "status"), registry=self.registry)
        self.in_flight = Gauge("tokenrelay_gateway_in_flight", "Requests being answered",
                               ("endpoint",), registry=self.registry)
        self.tokens = Counter("tokenrelay_gateway_tokens", "Tokens of finished requests",
                              ("kind",), registry=self.registry)
        self.cancelled = Counter("tokenrelay_gateway_disconnect_cancels",
                                 "Jobs cancelled because their client went away",
                                 registry=self.registry)
        self.parked = Counter("tokenrelay_gateway_streams_parked",
                              "Streams whose client left, kept for --resume-grace-s",
                              registry=self.registry)
        self.resumes = Counter("tokenrelay_gateway_stream_resumes",
                               "Streams a client resumed with Last-Event-ID",
                               registry=self.registry)
        self.ttft = Histogram("tokenrelay_gateway_time_to_first_token_seconds",
                              "Request start to its first token", registry=self.registry,
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.cancels_pending = Gauge("tokenrelay_gateway_cancels_pending",
                                     "Cancel flags owed and not yet set in Redis",
                                     registry=self.registry)
        self.cancel_retries = Counter("tokenrelay_gateway_cancel_retries",
                                      "Rounds of cancel flags that failed and were retried",
                                      registry=self.registry)
        self.readers = Gauge("tokenrelay_gateway_result_readers",
                             "Shared result readers (one blocking XREAD each)",
                             registry=self.registry)
        self.watched = Gauge("tokenrelay_gateway_streams_watched",
                             "Result streams the shared readers read for waiting requests",
                             registry=self.registry)

    def bind(self, gateway: Any) -> None:
        """Gauges read from the gateway's shared readers when scraped."""
        self.readers.set_function(lambda: gateway.hub.readers if gateway.hub else 0)
        self.watched.set_function(lambda: len(gateway.hub.watches) if gateway.hub else 0)
