"""What every tokenrelay command line shares: the connection flags (before or after the
subcommand, defaults from ``TOKENRELAY_*``) and how it ends when its reader goes away
(``... | head``). Used by ``python -m producer_sdk`` and ``python -m worker admin``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

EXIT_SIGPIPE = 141      # what a shell reports for a process ended by SIGPIPE (128 + 13)


def run_cli(main: Callable[[], int]) -> int:
    """Run a CLI's ``main``; when the reader of stdout closed it early, end quietly with 141
    instead of a BrokenPipeError traceback (the way ``cat`` or ``grep`` end under ``head``)."""
    try:
        code = main()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # Python flushes stdout once more at exit: point it at /dev/null so that cannot fail.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_SIGPIPE


def add_connection_flags(p: argparse.ArgumentParser, top: bool, queue_help: str = "") -> None:
    """``--redis-url``, ``--namespace``, ``--queue`` on a command (``top``) and on each of its
    subcommands, so they may come before or after it; below the top they default to SUPPRESS
    and so never undo a value given above. Defaults come from TOKENRELAY_* at parse time."""
    def default(value: Any) -> dict[str, Any]:
        return {"default": value if top else argparse.SUPPRESS}
    p.add_argument("--redis-url", **default(os.environ.get("TOKENRELAY_REDIS_URL")),
                   help="Redis URL [default: $TOKENRELAY_REDIS_URL or redis://127.0.0.1:6379/0]")
    p.add_argument("--namespace", **default(os.environ.get("TOKENRELAY_NAMESPACE", "tokenrelay")),
                   help="key prefix [default: $TOKENRELAY_NAMESPACE or tokenrelay]")
    p.add_argument("--queue", **default(os.environ.get("TOKENRELAY_QUEUE")),
                   help=f"queue name [default: $TOKENRELAY_QUEUE or default{queue_help}]")
