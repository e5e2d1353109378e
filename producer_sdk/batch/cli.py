"""``tokenrelay batch`` and ``tokenrelay status --batch``: the batch runner from a shell.

``batch`` exits 1 (``exit_codes.EXIT_FAILED``) while the run's errors file holds any line (a
failed or malformed request, of this run or an earlier one of the same output), unless
``--allow-failures``: a nightly job can tell a partial run from a clean one. ``status
--batch`` counts where every job stands and, given the run's output or errors file, the
errors file's lines by code.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tokenrelay.producer_sdk.batch.lines import error_counts
from tokenrelay.producer_sdk.cli.exit_codes import EXIT_FAILED, EXIT_INVALID


def status_line(name: str, st: Any) -> str:
    """One job's status as a line: its name, state and the fields that say something."""
    shown = {k: v for k, v in st.model_dump(exclude={"job_id", "state"}).items()
             if v not in (None, False, 0) or (k == "position" and v == 0)}
    return " ".join([name, st.state, *(f"{k}={v}" for k, v in shown.items())])


def cmd_batch_status(client: Any, opts: Any) -> int:
    """Every job of a batch, found from its input file (``producer_sdk.batch.status``), each
    custom_id once; the lines that are no request, named; then the counts by state."""
    from tokenrelay.producer_sdk.batch.runner import scan_input
    from tokenrelay.producer_sdk.batch.lines import job_id_for
    from tokenrelay.producer_sdk.batch.status import read_batch_lines, statuses_anywhere
    path = Path(opts.batch)
    batch_id = opts.batch_id or f"batch_{scan_input(path)[1][:24]}"
    lines = read_batch_lines(path)
    statuses = statuses_anywhere(client, [job_id_for(batch_id, c) for c in lines.custom_ids])
    counts: dict[str, int] = {}
    for cid, st in zip(lines.custom_ids, statuses):
        counts[st.state] = counts.get(st.state, 0) + 1
        print(json.dumps({"custom_id": cid, **st.model_dump()}) if opts.json
              else status_line(cid, st))
    for lineno, why in lines.malformed:
        print(json.dumps({"line": lineno, "malformed": why}) if opts.json
              else f"line {lineno} malformed: {why}")
    print(json.dumps({"batch_id": batch_id, "jobs": len(statuses), **counts,
                      "malformed_lines": len(lines.malformed), **errors_file(opts)}),
          file=sys.stderr)
    return 0


def errors_file(opts: Any) -> dict[str, Any]:
    """The errors file of the run (``--errors``, else ``--output``'s), counted by code; {}
    when neither is given."""
    if opts.errors is None and opts.output is None:
        return {}
    path = Path(opts.errors) if opts.errors else Path(str(opts.output)).with_suffix(
        ".errors.jsonl")
    counts = error_counts(path)
    return {"errors_file": str(path), "errors_file_lines": sum(counts.values()),
            "errors_by_code": counts}


def cmd_batch(client: Any, args: argparse.Namespace, opts: Any) -> int:
    """Run (or resume) a batch; 2 when no line is a request, 1 while the errors file holds
    a line (unless --allow-failures)."""
    from tokenrelay.producer_sdk.batch.runner import BatchRunner
    runner = BatchRunner(client, args.input, args.output, opts.errors, batch_id=opts.batch_id,
                         concurrency=opts.concurrency, priority=opts.priority,
                         progress=opts.progress, durable=opts.durable,
                         wait_log_s=opts.wait_log_s)
    try:
        summary = runner.run()
    except KeyboardInterrupt:
        print("\ninterrupted: jobs in flight keep running; rerun the same command to resume",
              file=sys.stderr)
        return 130
    print(json.dumps(summary.as_dict()), file=sys.stderr)
    if summary.total_lines and not (summary.succeeded + summary.failed + summary.skipped):
        print(f"error: no line of {args.input} is a valid request (see {runner.errors})",
              file=sys.stderr)
        return EXIT_INVALID
    if summary.errors_file_lines and not opts.allow_failures:
        print(f"error: {summary.errors_file_lines} line(s) of {args.input} failed or were "
              f"malformed (see {runner.errors}); --allow-failures exits 0 anyway",
              file=sys.stderr)
        return EXIT_FAILED
    return 0


__all__ = ["cmd_batch", "cmd_batch_status", "errors_file", "status_line"]
