"""Structured JSON logs: one line per job lifecycle event, greppable by job_id and entry id.

Prompts never reach the log unless ``--log-prompts`` is set: prompts are user data.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog

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


def get_logger(**bind: Any) -> Any:
    return structlog.get_logger("tokenrelay.worker").bind(**bind)
