"""``tokenrelay worker [--flags]`` runs a worker; ``tokenrelay health`` probes one;
``tokenrelay admin ...`` inspects and repairs the queue (worker/admin.py).

SIGTERM/SIGINT start the drain (stop reading, let running jobs finish until --drain-timeout,
hand the rest back); a second signal hands back at once.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Callable, Optional


def main(argv: Optional[list[str]] = None,
         engine_factory: Optional[Callable[..., object]] = None,
         fault_point: Optional[Callable[[str], None]] = None) -> int:
    """The CLI; ``engine_factory`` (default worker.engine_api.load_engine) lets a test-only
    entry wrap the engine, ``fault_point`` stop the worker at a point of a flush
    (tests/fault_worker.py; worker/outbox.py, FAULT_POINTS)."""
    from tokenrelay.protocol.settings import parse_settings
    from tokenrelay.worker.config import build_parser
    parser = build_parser()
    args, settings = parse_settings(parser, sys.argv[1:] if argv is None else argv)
    if args.command == "health":
        from tokenrelay.worker.health import run as run_health
        return run_health(settings)
    if args.command == "admin":
        from tokenrelay.worker.admin import run as run_admin
        return run_admin(args, settings)
    if not settings.model:
        parser.error("--model (or TOKENRELAY_MODEL) is required")
    from tokenrelay.protocol.grammar_probe import skip_in_this_process
    skip_in_this_process()      # its engine compiles constraints with the model's tokenizer
    from tokenrelay.worker.engine_api import openmp_defaults
    for name, value in openmp_defaults().items():   # before torch loads its OpenMP runtime
        os.environ.setdefault(name, value)
    from tokenrelay.worker.logs import configure_logging, get_logger
    configure_logging(settings.log_level)
    from tokenrelay.worker.preflight import check_redis
    refused = check_redis(settings, get_logger(queue=settings.queue))
    if refused is not None:
        return refused
    from tokenrelay.worker.service import Worker
    seams: dict = {}
    if engine_factory is not None:
        seams["engine_factory"] = engine_factory
    if fault_point is not None:
        seams["fault_point"] = fault_point
    worker = Worker(settings, **seams)

    def on_signal(signum: int, _frame: object) -> None:
        worker.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return worker.run()


if __name__ == "__main__":
    from tokenrelay.protocol.settings import run_cli
    sys.exit(run_cli(main))
