"""The in-flight window of ``iter_completed`` and the bookkeeping of ``map``, without I/O.

Both clients run the same window: ``refill`` (enqueue what fits, reattach known ids) and
``read`` (one XREAD over everything in flight) are plans, ``cancel_rest`` is the cleanup when
the reader stops early; the clients only loop over them and hand the finished pairs on.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Protocol, Sequence

from tokenrelay.producer_sdk.core.effects import NET_ERRORS, Plan
from tokenrelay.producer_sdk.errors import DUPLICATE, JobFailed, RedisUnavailable
from tokenrelay.producer_sdk.jobs.job import Delta, JobHandle, JobState
from tokenrelay.producer_sdk.jobs.payloads import Prepared
from tokenrelay.protocol.scripts.cancel import CancelTarget

Pair = tuple[Any, Any]      # (the caller's tag, its job handle)


class WindowOps(Protocol):
    """What a window needs of its client: the plans it runs (``ClientCore`` has them)."""

    def _enqueue(self, prepared: Sequence[Prepared], *, block: bool,
                 block_timeout: Optional[float] = None,
                 durable: Optional[bool] = None) -> Plan[list[Any]]: ...

    def _probe(self, jobs: Sequence[JobHandle]) -> Plan[list[str]]: ...

    def _pump(self, states: Iterable[JobState],
              block_ms: int) -> Plan[list[tuple[JobState, list[Delta]]]]: ...

    def _cancel_jobs(self, targets: Sequence[CancelTarget]) -> Plan[list[bool]]: ...


def take_batch(it: Iterator[Any], room: int) -> tuple[list[Any], bool]:
    """Up to ``room`` items from ``it`` (at least one when any is left), and whether ``it`` ran
    out: the window refills from a lazy source with this."""
    batch: list[Any] = []
    for item in it:
        batch.append(item)
        if len(batch) >= room:
            return batch, False
    return batch, True


class Window:
    """(tag, prepared job) pairs from ``source`` with at most ``concurrency`` in flight.

    Already-known job ids reattach instead of resubmitting; those whose results expired come
    back finished with a 'lost' JobFailed, and an id already in flight in this window comes
    back failed as a duplicate."""

    def __init__(self, ops: WindowOps, source: Iterable[tuple[Any, Prepared]], concurrency: int,
                 block: bool, durable: Optional[bool], poll_ms: int,
                 on_submitted: Optional[Callable[[list[Pair]], None]] = None) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.ops = ops
        self.it = iter(source)
        self.concurrency = concurrency
        self.block = block
        self.durable = durable
        self.poll_ms = poll_ms
        self.on_submitted = on_submitted
        self.inflight: dict[str, Pair] = {}
        self.exhausted = False

    @property
    def over(self) -> bool:
        return self.exhausted and not self.inflight

    def refill(self) -> Plan[list[Pair]]:
        """Enqueue what fits in the window; the pairs that finished at once."""
        if self.exhausted or len(self.inflight) >= self.concurrency:
            return []
        batch, self.exhausted = take_batch(self.it, self.concurrency - len(self.inflight))
        if not batch:
            return []
        jobs = yield from self.ops._enqueue([p for _, p in batch], block=self.block,
                                            durable=self.durable)
        pairs = [(tag, job) for (tag, _), job in zip(batch, jobs)]
        reattached = [j for _, j in pairs if j.reattached]
        if reattached:
            yield from self.ops._probe(reattached)
        if self.on_submitted:
            self.on_submitted(pairs)
        finished = []
        for tag, job in pairs:
            if job.state.finished:
                finished.append((tag, job))
            elif job.state.key in self.inflight:
                job.state.fail(DUPLICATE, f"job id {job.id} is already in flight in this "
                               f"window (duplicate request id)")
                finished.append((tag, job))
            else:
                self.inflight[job.state.key] = (tag, job)
        return finished

    def read(self) -> Plan[list[Pair]]:
        """One read over the window; the pairs that finished."""
        if not self.inflight:
            return []
        got = yield from self.ops._pump([j.state for _, j in self.inflight.values()],
                                        self.poll_ms)
        return [self.inflight.pop(state.key) for state, _ in got if state.finished]

    def cancel_rest(self) -> Plan[None]:
        """Cancel what is still in flight, best effort (while unwinding, the original
        exception matters more)."""
        if not self.inflight:
            return
        try:
            yield from self.ops._cancel_jobs([j.cancel_target
                                              for _, j in self.inflight.values()])
        except (*NET_ERRORS, RedisUnavailable):
            pass


def map_defaults(sampling: Mapping[str, Any], job_fields: Mapping[str, Any]) -> dict[str, Any]:
    """Defaults for map(): results only, so stream=False unless token logprobs are wanted."""
    defaults = {**sampling, **job_fields}
    defaults.setdefault("stream", sampling.get("logprobs") is not None)
    return defaults


class MapRun:
    """One ``map()`` call: its requests built lazily as the window pulls them, the results in
    input order (a JobFailed raised, or put in its slot with ``return_exceptions``), and a
    progress bar."""

    def __init__(self, build: Callable[[Any, Mapping[str, Any]], Prepared],
                 requests: Iterable[Any], defaults: Mapping[str, Any], progress: bool,
                 return_exceptions: bool) -> None:
        self.build = build
        self.requests = requests
        self.defaults = defaults
        self.return_exceptions = return_exceptions
        self.results: list[Any] = []
        self.bar = progress_bar(_len_or_none(requests), progress, "map")

    def source(self) -> Iterator[tuple[int, Prepared]]:
        for i, req in enumerate(self.requests):
            self.results.append(None)
            yield i, self.build(req, self.defaults)

    def done(self, i: int, job: JobHandle) -> None:
        try:
            self.results[i] = job.state.result()
        except JobFailed as exc:
            if not self.return_exceptions:
                raise
            self.results[i] = exc
        self.bar.update(1)

    def __enter__(self) -> "MapRun":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.close()


def progress_bar(total: Optional[int], enabled: bool, desc: str) -> Any:
    """A tqdm bar (rate and ETA) or a no-op stand-in."""
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="job", dynamic_ncols=True)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _len_or_none(x: Any) -> Optional[int]:
    try:
        return len(x)
    except TypeError:
        return None


__all__ = ["Window", "WindowOps", "MapRun", "take_batch", "map_defaults", "progress_bar"]
