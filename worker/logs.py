"""Structured JSON logs: one line per job lifecycle event, greppable by job_id and entry id.

Prompts never reach the log unless ``--log-prompts`` is set: prompts are user data.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

import structlog
from structlog.typing import FilteringBoundLogger

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def configure_logging(level: str = "info", stream: TextIO | None = None) -> None:
    """JSON lines on stderr (or ``stream``). Idempotent; safe to call from every Worker."""
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(default=str),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level.lower(),
                                                                        logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )


# The worker's logger, as collaborators are given it (bound with the worker's id and queue).
Log = FilteringBoundLogger


def get_logger(**bind: Any) -> Log:
    return structlog.get_logger("tokenrelay.worker").bind(**bind)


class RateLimitedLog:
    """Logs the same message at most once per ``every_s`` seconds, with how many were
    suppressed in between. Why: a loop that retries a failing Redis command every few
    milliseconds once wrote 500,000 identical lines (160 MB) in 40 s."""

    def __init__(self, log: Any, every_s: float = 5.0) -> None:
        self._log = log
        self._every_s = every_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def __call__(self, level: str, message: str, **fields: Any) -> None:
        now = time.monotonic()
        if now - self._last.get(message, -1e18) < self._every_s:
            self._suppressed[message] = self._suppressed.get(message, 0) + 1
            return
        self._last[message] = now
        suppressed = self._suppressed.pop(message, 0)
        if suppressed:
            fields["suppressed"] = suppressed
        getattr(self._log, level)(message, **fields)
