"""How every tokenrelay command line ends when its reader goes away (``... | head``)."""

from __future__ import annotations

import os
import sys
from typing import Callable

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
