"""The exit codes of the producer commands (``tokenrelay submit|batch|status|result|cancel|
stats``): one table, read by the commands, by their ``--help`` and written in the README
(tests/sdk/test_exit_codes.py keeps the README's table equal to this one)."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1         # a job failed; batch: the errors file holds a failed or malformed line
EXIT_INVALID = 2        # a bad request or argument (nothing was sent)
EXIT_UNAVAILABLE = 3    # Redis unreachable
EXIT_FULL = 4           # the queue is full
EXIT_TIMEOUT = 5        # --timeout passed before the result
EXIT_UNKNOWN = 6        # status/result/cancel of a job id Redis does not know
EXIT_NOT_DURABLE = 7    # a --durable submit's jobs are enqueued but not on enough replicas
EXIT_NO_WORKER = 8      # submit: no live worker serves the queue or --model
EXIT_LOCKED = 9         # batch: another run is writing the same output file
EXIT_FINISHED = 10      # cancel: the job had already finished (nothing to cancel)

EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "ok"),
    (EXIT_FAILED, "a job failed; batch: a line failed or was malformed (the errors file "
                  "holds it; --allow-failures exits 0)"),
    (EXIT_INVALID, "bad request or arguments; nothing was sent"),
    (EXIT_UNAVAILABLE, "Redis cannot be reached"),
    (EXIT_FULL, "the queue is full (--block waits for room)"),
    (EXIT_TIMEOUT, "--timeout passed before the result"),
    (EXIT_UNKNOWN, "status/result/cancel: Redis knows no such job id on the queue searched"),
    (EXIT_NOT_DURABLE, "--durable: enqueued, but fewer replicas than asked acknowledged"),
    (EXIT_NO_WORKER, "submit: no live worker serves the queue or --model "
                     "(--wait-for-worker submits anyway)"),
    (EXIT_LOCKED, "batch: another run is writing the same output file"),
    (EXIT_FINISHED, "cancel: the job had already finished; nothing was cancelled"),
)


def exit_table() -> str:
    """The table as ``--help`` shows it."""
    return "exit codes:\n" + "\n".join(f"  {code:>2}  {what}" for code, what in EXIT_CODES)


__all__ = [name for name in dir() if name.startswith("EXIT")] + ["exit_table"]
