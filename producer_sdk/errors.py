"""Exceptions a producer can branch on.

Each one says what happened and what to do about it, because the person reading the traceback is
usually a web-backend engineer who has never seen the worker side.
"""

from __future__ import annotations

from typing import Any, Optional


class SDKError(Exception):
    """Base class of every error the SDK raises on its own (not ValueError/ConnectionError)."""


class InvalidRequest(ValueError):
    """A job that would be rejected by the worker; raised before anything is sent.

    Subclasses ValueError so ``except ValueError`` around ``submit`` keeps working.
    """

    def __init__(self, message: str, field: Optional[str] = None) -> None:
        super().__init__(message)
        self.field = field


class LineError(Exception):
    """An OpenAI-shaped request body (a gateway request, a batch line) that cannot become a
    job: ``code`` says why (``invalid_request``, ``unsupported_field``, ...), ``param`` names
    the body field when one is to blame."""

    def __init__(self, code: str, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


class ModelNotFound(SDKError, LookupError):
    """No live worker serves the model a request names (its ``model``): nothing was sent.
    The one wording of it, for the SDK, the CLI, the batch runner's errors file and the
    gateway's 404."""

    def __init__(self, model: str, served: list[str]) -> None:
        listed = ", ".join(served) if served else "none (no worker is live)"
        super().__init__(f"no live worker serves the model {model!r}; served now: {listed}. "
                         f"Ask for a served model, or start a worker with --served-model-name "
                         f"{model} on a queue of its own")
        self.model = model
        self.served = served


class RedisUnavailable(ConnectionError):
    """Redis could not be reached (refused, DNS, timeout). Subclasses the builtin ConnectionError."""

    def __init__(self, url: str, cause: BaseException) -> None:
        super().__init__(
            f"cannot reach Redis at {url}: {type(cause).__name__}: {cause}. Check that redis-server "
            f"is running and that --redis-url / TOKENRELAY_REDIS_URL points at it.")
        self.url = url


class QueueFull(SDKError):
    """The queue is past its high-water mark, or its token budget (or Redis is out of memory).

    Retry later, submit with ``block=True`` to wait for room, or raise ``max_queued_jobs`` /
    ``max_queued_tokens`` (per client, or for everyone via the queue's config hash).
    ``reason`` says which bound refused: ``high-water mark`` (``depth`` of ``limit`` jobs),
    ``token budget`` (``tokens`` queued on the job's shard of its share ``token_limit``) or
    ``oom``. ``accepted`` holds the jobs that a ``submit_many`` call did enqueue before the
    queue filled up.
    """

    def __init__(self, queue: str, depth: Optional[int], limit: Optional[int],
                 reason: str = "high-water mark", accepted: Optional[list[Any]] = None,
                 tokens: Optional[int] = None, token_limit: Optional[int] = None) -> None:
        if reason == "oom":
            msg = (f"queue {queue!r}: Redis is out of memory (maxmemory reached); treat as "
                   f"back-pressure: wait for workers to drain results, or raise maxmemory")
        elif reason == "token budget":
            msg = (f"queue {queue!r} is at its token budget: {tokens} tokens queued or running "
                   f"on the job's shard, whose share of max_queued_tokens is {token_limit}, and "
                   f"the job's cost does not fit; retry later, pass block=True to wait, or "
                   f"raise max_queued_tokens")
        else:
            msg = (f"queue {queue!r} holds {depth} jobs, at its high-water mark of {limit}; retry "
                   f"later, pass block=True to wait, or raise max_queued_jobs")
        super().__init__(msg)
        self.queue = queue
        self.depth = depth
        self.limit = limit
        self.reason = reason
        self.tokens = tokens
        self.token_limit = token_limit
        self.accepted = accepted or []


class NotDurable(SDKError):
    """A durable submit's jobs are enqueued, but fewer replicas than asked acknowledged them
    within the timeout (``WAIT``): until one does, a failover of their master can lose them.

    The jobs stay enqueued: ``jobs`` holds every job of the call (handles, as a successful call
    returns them), ``job_ids`` those short of ``asked`` replicas. Wait and check, or submit the
    same job ids again with ``durable=True`` (the dedupe record makes that a no-op for a job
    that survived, and re-enqueues one a failover lost). A server without replicas can never
    acknowledge: ``acked`` is 0 there.
    """

    def __init__(self, acked: int, asked: int, job_ids: list[str], jobs: list[Any],
                 detail: str = "") -> None:
        shown = ", ".join(job_ids[:5]) + (f" and {len(job_ids) - 5} more" if len(job_ids) > 5
                                          else "")
        super().__init__(f"{len(job_ids)} job(s) enqueued but acknowledged by {acked} of "
                         f"{asked} replica(s) asked: {shown}"
                         f"{'; ' + detail if detail else ''}. A failover now can lose them; "
                         f"resubmit the same job ids with durable=True to make sure")
        self.acked = acked
        self.asked = asked
        self.job_ids = job_ids
        self.jobs = jobs


class JobFailed(SDKError):
    """The job ended with a terminal ``error`` event. ``code`` is a protocol ErrorCode value."""

    def __init__(self, job_id: str, code: str, message: str) -> None:
        super().__init__(f"job {job_id} failed [{code}]: {message}")
        self.job_id = job_id
        self.code = code
        self.message = message


class ClientClosed(SDKError, RuntimeError):
    """The client was closed; it does not reconnect behind your back. Create a new one."""

    def __init__(self, what: str = "Client") -> None:
        super().__init__(f"this {what} was closed; create a new {what} to talk to Redis again")


class JobNotFound(SDKError, LookupError):
    """No job with this id is known to Redis (never submitted, or its records expired)."""

    def __init__(self, job_id: str, queue: Optional[str] = None,
                 namespace: Optional[str] = None) -> None:
        where = (f"on queue {queue!r} of namespace {namespace!r}" if queue is not None
                 else "in this namespace")
        super().__init__(f"no job {job_id!r} {where}: it was never submitted to that queue "
                         f"(a job routed by its model is on its model's queue: pass that "
                         f"queue), or its dedupe record and result stream have expired")
        self.job_id = job_id
        self.queue = queue


# The SDK's own JobFailed codes (not protocol ErrorCodes): a job whose records vanished (result
# stream expired before it was read), and a job id given twice within one bulk window.
LOST = "lost"
DUPLICATE = "duplicate"
# A job whose records (result stream and dedupe record) vanished while a reader waited: a Redis
# restarted without its data, a failover that lost the enqueue. A reader holding the request
# puts it back in its queue instead (docs/protocol.md, "A job Redis lost").
JOB_LOST = "job_lost"
