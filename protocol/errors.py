"""Error codes, finish reasons and the one exception for a payload that breaks the protocol.

Shared by every side: the worker ends jobs with these codes, the SDK and the gateway map them to
their own errors. Imports nothing of this package, so any module here may raise them.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Optional

from pydantic import ValidationError


class ErrorCode(str, Enum):
    """Codes of terminal ``error`` events. Clients may branch on them; messages are for people."""

    INVALID_REQUEST = "invalid_request"      # malformed payload or sampling params
    PROMPT_TOO_LONG = "prompt_too_long"      # prompt (+ max_tokens) cannot fit the model/worker
    EXPIRED = "expired"                      # deadline_ms passed before the job started
    CANCELLED = "cancelled"                  # reserved: cancellation ends with done/cancelled
    POISON = "poison"                        # delivered more than max_deliveries times
    INTERNAL = "internal"                    # engine failure that retrying will not fix
    DUPLICATE_JOB_ID = "duplicate_job_id"    # the job id names another live/known job's entry


class FinishReason(str, Enum):
    STOP = "stop"            # EOS, a stop token or a stop string
    LENGTH = "length"        # max_tokens or max_model_len reached
    CANCELLED = "cancelled"  # the producer cancelled the job


class ProtocolError(ValueError):
    """A payload that does not follow protocol v1. Carries the job id when one could be read, and
    ``field``: the dotted name of the offending field (``"params.stop"``), None for the payload
    as a whole, and ``metadata``: the payload's metadata when it is what a valid job could carry
    (the error event echoes it so clients can correlate), else ``{}``."""

    def __init__(self, message: str, job_id: Optional[str] = None,
                 code: ErrorCode = ErrorCode.INVALID_REQUEST, field: Optional[str] = None,
                 metadata: Optional[dict[str, Any]] = None) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.code = code
        self.field = field
        self.metadata: dict[str, Any] = metadata or {}



def first_field(exc: ValidationError, prefix: str = "") -> Optional[str]:
    loc = [str(p) for p in (exc.errors()[0].get("loc", ()) if exc.errors() else ())]
    name = ".".join([prefix, *loc] if prefix else loc)
    return name or None


def describe_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """One line naming each bad field (dotted, under ``prefix``), for messages a person reads."""
    parts = []
    errors = exc.errors()
    for err in errors[:_MAX_DESCRIBED]:
        loc = ".".join([prefix, *map(str, err.get("loc", ()))] if prefix else
                       map(str, err.get("loc", ()))) or "payload"
        parts.append(f"{loc}: {err.get('msg')}")
    if len(errors) > _MAX_DESCRIBED:
        parts.append(f"and {len(errors) - _MAX_DESCRIBED} more errors")
    return "; ".join(parts)


_MAX_DESCRIBED = 5  # a list of a million bad token ids must not make a million-part message
