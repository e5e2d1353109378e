"""Prometheus metrics, vLLM-style names with a ``tokenrelay_`` prefix.

Each Worker owns a registry (several in-process workers in one test must not collide); the
HTTP server is started only when ``--metrics-port`` is non-zero. Every sample carries a
``model_name`` label, as vLLM's do, added once at export (``_Labelled``) rather than at every
call site. Counters are exported with prometheus_client's ``_total`` suffix; the prefix cache is
two counters (tokens queried, tokens hit), which sum across workers where a hit-rate gauge
cannot: ``rate(hits) / rate(queries)`` is the fleet's hit rate.
"""

from __future__ import annotations

from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.metrics_core import Metric

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
        0.75, 1.0, 2.5)


def observe_many(histogram: Histogram, value: float, count: int) -> None:
    """``histogram.observe(value)`` ``count`` times, in one bucket increment: the worker observes
    one inter-token gap per token, and the sequences of one step share their gap, so a step of
    256 sequences is one or two of these instead of 256 ``observe`` calls (issue #29). Uses
    prometheus_client's bucket layout (``_upper_bounds``, ``_buckets``, ``_sum``), the same
    fields ``observe`` updates; tests/worker/test_metrics.py holds the two equal."""
    if count <= 0:
        return
    histogram._raise_if_not_observable()
    histogram._sum.inc(value * count)
    for bucket, bound in zip(histogram._buckets, histogram._upper_bounds):
        if value <= bound:
            bucket.inc(count)
            return


class _Labelled:
    """A collector that re-exports another registry's metrics with constant labels added."""

    def __init__(self, inner: CollectorRegistry, labels: dict[str, str]) -> None:
        self.inner = inner
        self.labels = labels

    def collect(self) -> Any:
        for family in self.inner.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                out.add_sample(s.name, {**s.labels, **self.labels}, s.value, s.timestamp,
                               s.exemplar)
            yield out


class WorkerMetrics:
    def __init__(self, registry: Optional[CollectorRegistry] = None,
                 model_name: str = "") -> None:
        r = self.registry = registry or CollectorRegistry()
        self.exported = CollectorRegistry(auto_describe=True)
        self.exported.register(_Labelled(r, {"model_name": model_name}))
        self.running = Gauge("tokenrelay_num_requests_running", "Requests running in the engine.",
                             registry=r)
        self.waiting = Gauge("tokenrelay_num_requests_waiting", "Requests waiting in the engine.",
                             registry=r)
        self.queue_time = Histogram("tokenrelay_request_queue_time_seconds",
                                    "Enqueue to start on a worker.", buckets=_LATENCY, registry=r)
        self.ttft = Histogram("tokenrelay_time_to_first_token_seconds",
                              "Enqueue to first token.", buckets=_LATENCY, registry=r)
        self.itl = Histogram("tokenrelay_inter_token_latency_seconds",
                             "Time between token events of a request, per token.",
                             buckets=_ITL, registry=r)
        self.e2e = Histogram("tokenrelay_e2e_request_latency_seconds",
                             "Enqueue to terminal event.", buckets=_LATENCY, registry=r)
        self.prompt_tokens = Counter("tokenrelay_prompt_tokens", "Prefill tokens processed.",
                                     registry=r)
        self.generation_tokens = Counter("tokenrelay_generation_tokens",
                                         "Generated tokens.", registry=r)
        self.kv_usage = Gauge("tokenrelay_kv_cache_usage_perc", "KV blocks in use (0-1).",
                              registry=r)
        self.prefix_queries = Counter("tokenrelay_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.", registry=r)
        self.prefix_hits = Counter("tokenrelay_prefix_cache_hits",
                                   "Prompt tokens served from the prefix cache.", registry=r)
        self.preemptions = Counter("tokenrelay_num_preemptions", "Engine preemptions.", registry=r)
        self.stream_lag = Gauge("tokenrelay_stream_lag", "Entries not yet delivered to any worker.",
                                ["lane"], registry=r)
        self.stream_pending = Gauge("tokenrelay_stream_pending",
                                    "Entries delivered but not acknowledged.", ["lane"], registry=r)
        self.errors = Counter("tokenrelay_request_errors", "Jobs ended with an error event.",
                              ["code"], registry=r)
        self.finished = Counter("tokenrelay_request_success", "Jobs ended with a done event.",
                                ["finished_reason"], registry=r)
        self.dead_letters = Counter("tokenrelay_dead_letters", "Entries dead-lettered.",
                                    ["code"], registry=r)
        self.redis_reconnects = Counter("tokenrelay_redis_reconnects", "Reconnects to Redis.",
                                        registry=r)
        self.step_redis = Histogram("tokenrelay_step_redis_seconds",
                                    "Time of the per-step Redis pipeline.", buckets=_ITL,
                                    registry=r)
        self.engine_step = Histogram("tokenrelay_engine_step_seconds",
                                     "Duration of engine.step().", buckets=_ITL, registry=r)
        self.events_cpu = Counter("tokenrelay_step_events_cpu_seconds",
                                  "CPU seconds spent turning engine deltas into events, "
                                  "flushing them to Redis and accounting the step (the "
                                  "writer's thread when steps overlap).", registry=r)
        self.structured_mask = Counter("tokenrelay_structured_mask_seconds",
                                       "Time computing structured-output token masks.",
                                       registry=r)
        self._seen: dict[str, float] = {}   # engine totals already added to the counters
        self._server: Any = None

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        if port:
            self._server = start_http_server(port, addr=host, registry=self.exported)

    def close(self) -> None:
        if self._server is not None:
            server, _thread = self._server
            server.shutdown()
            self._server = None

    def observe_engine(self, stats: dict[str, Any]) -> None:
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        total = stats.get("kv_blocks_total") or 0
        if total:
            self.kv_usage.set(stats.get("kv_blocks_used", 0) / total)
        for key, counter in (("num_preemptions", self.preemptions),
                             ("prefix_cache_query_tokens", self.prefix_queries),
                             ("prefix_cache_hit_tokens", self.prefix_hits)):
            self._add(key, counter, int(stats.get(key, 0) or 0))
        self._add("structured_mask_seconds", self.structured_mask,
                  float(stats.get("structured_mask_seconds", 0.0) or 0.0))

    def _add(self, key: str, counter: Counter, total: float) -> None:
        """Add what an engine total grew by since the last look."""
        if total > self._seen.get(key, 0):
            counter.inc(total - self._seen.get(key, 0))
        self._seen[key] = total
