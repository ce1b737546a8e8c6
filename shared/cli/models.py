"""``neuroshard model ...``: fetch a train job's saved model, list the jobs that have one.

``model get JOB`` writes the coordinator's ``torch.save`` of the job's state dict to
``JOB.pt`` (``JOB.best.pt`` with ``--best``) or ``-o FILE``; load it with
``torch.load(FILE, weights_only=True)``. A later job starts from it with ``init: {job: JOB}``.
A refusal by the coordinator exits 1 (NOT_FOUND for an unknown job or another user's)
(``shared.cli.main``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
from typing import Any

from shared.cli.security import add_client_command, client_security_of

EXIT_OK = 0


def cmd_get(args: argparse.Namespace) -> int:
    """Stream a job's saved model (final, or best with ``--best``) to a file."""
    from shared.client import SyncClient

    path = args.output or f"{args.job_id}{'.best' if args.best else ''}.pt"
    with SyncClient(args.coordinator, security=client_security_of(args)) as client:
        info = client.get_model(args.job_id, path, best=args.best)
    if args.json:
        print(json.dumps(info))
        return EXIT_OK
    which = "best" if args.best else "final"
    print(
        f"wrote {info['path']}: {which} model of {info['job_id']}, {info['bytes']} bytes, "
        f"sha256 {info['sha256']}"
    )
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    """List the jobs with a saved model (the caller's; every job for an admin)."""
    from shared.client import SyncClient

    with SyncClient(args.coordinator, security=client_security_of(args)) as client:
        listed = client.list_models()
    if args.json:
        print(json.dumps(listed, indent=2))
        return EXIT_OK
    _print_listing(listed)
    return EXIT_OK


def _print_listing(listed: list[dict[str, Any]]) -> None:
    """Print the saved models as a table (times in local time)."""
    from rich.table import Table

    from shared.cli.output import out_console

    if not listed:
        out_console.print("no saved models (a train job saves one when it ends)")
        return
    table = Table()
    table.add_column("job", no_wrap=True)  # a job id is what the reader copies: never folded
    for col in ("kind", "strategy", "best acc", "bytes", "best bytes", "saved"):
        table.add_column(col)
    for m in listed:
        acc = m["best_test_accuracy"]
        when = dt.datetime.fromtimestamp(m["saved_at"]).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(
            m["job_id"],
            m["kind"],
            m["strategy"],
            "-" if acc is None else f"{acc:.4f}",
            str(m["bytes"]) if m["bytes"] else "-",
            str(m["best_bytes"]) if m["best_bytes"] else "-",
            when,
        )
    out_console.print(table)


def add_model_commands(parser: argparse.ArgumentParser) -> None:
    """Add ``get`` and ``ls`` under ``model``.

    ``--coordinator`` and the TLS and token flags are accepted before or after the
    subcommand.
    """
    sub = parser.add_subparsers(dest="model_command", required=True, metavar="COMMAND")

    g = add_client_command(sub, "get", "write a train job's saved model to a file", cmd_get)
    g.add_argument("job_id", help="the train job (yours; any for an admin)")
    g.add_argument(
        "-o", "--output", help="file to write (default JOB.pt, or JOB.best.pt with --best)"
    )
    g.add_argument(
        "--best", action="store_true", help="the best model by test accuracy, not the final one"
    )
    g.add_argument("--json", action="store_true", help="print one JSON document")

    ls = add_client_command(sub, "ls", "list the jobs that have a saved model", cmd_ls)
    ls.add_argument("--json", action="store_true", help="print a JSON list")
