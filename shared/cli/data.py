"""``neuroshard data ...``: put a data set into the coordinator's data roots, list them.

A job then names an uploaded set by its file name: ``data: {path: NAME.npz}`` (train) or
``load: NAME.npz`` (memory). The coordinator validates the file as it arrives and serves the
workers their shards' rows itself, so no filesystem is shared between the machines.
A missing local file exits 2; a refusal by the coordinator exits 2 when it is
INVALID_ARGUMENT, else 1 (``shared.cli.main``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from shared.cli.security import add_client_command, client_security_of

EXIT_OK, EXIT_USAGE = 0, 2
_USE = {
    "train": "data: {{path: {path}}}",
    "memory": "load: {path}",
    "weights": "init: {{dataset: {name}}}",
}


@contextlib.contextmanager
def _bytes_bar(what: str, total: int) -> Iterator[Callable[[int], None]]:
    """A rich progress bar in bytes on stderr when it is a terminal; yields ``advance(n)``."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from shared.cli.output import err_console

    columns = (
        what,
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(
        *columns, console=err_console, disable=not err_console.is_terminal, transient=True
    ) as progress:
        task = progress.add_task(what, total=total)
        yield lambda n: progress.advance(task, n)


def cmd_put(args: argparse.Namespace) -> int:
    """Upload an .npz or a directory of .npy as NAME.npz, or a .pt state dict as NAME.pt.

    Nothing is read whole: a file is sent in chunks, a directory as an .npz built as it goes.
    """
    from shared.client import SyncClient
    from shared.client.npz_stream import array_files, npz_size

    path = Path(args.file)
    if path.is_dir():
        size = npz_size(array_files(path))
    elif path.is_file():
        size = path.stat().st_size
    else:
        print(f"error: {path}: no such file", file=sys.stderr)
        return EXIT_USAGE
    security = client_security_of(args)
    with (
        SyncClient(args.coordinator, security=security) as client,
        _bytes_bar(f"uploading {path.name}", size) as advance,
    ):
        info = client.put_dataset(path, name=args.name, replace=args.replace, progress=advance)
    if args.json:
        print(json.dumps(info))
        return EXIT_OK
    _print_info(info)
    return EXIT_OK


def _print_info(info: dict[str, Any]) -> None:
    """Print a stored data set for people, with how a job names it."""
    print(f"stored {info['path']}: {info['bytes']} bytes, sha256 {info['sha256']}")
    for a in info["arrays"]:
        print(f"  {a['name']}: {a['dtype']} {a['shape']}")
    use = _USE.get(info["kind"])
    if use is not None:
        job = "train" if info["kind"] == "weights" else info["kind"]
        print(f"use it in a {job} job as  {use.format(path=info['path'], name=info['name'])}")


def cmd_ls(args: argparse.Namespace) -> int:
    """List the .npz and .npy files in the coordinator's data roots."""
    from shared.client import SyncClient

    with SyncClient(args.coordinator, security=client_security_of(args)) as client:
        listed = client.list_datasets()
    if args.json:
        print(json.dumps(listed, indent=2))
        return EXIT_OK
    _print_listing(listed)
    return EXIT_OK


def _print_listing(listed: list[dict[str, Any]]) -> None:
    """Print the data roots' files as a table (modification times in local time)."""
    from rich.table import Table

    from shared.cli.output import out_console

    if not listed:
        out_console.print("no data sets (neuroshard data put FILE.npz adds one)")
        return
    table = Table()
    for col in ("path", "bytes", "modified", "root", "owner"):
        table.add_column(col)
    for e in listed:
        when = dt.datetime.fromtimestamp(e["modified_at"]).isoformat(timespec="seconds")
        table.add_row(e["path"], str(e["bytes"]), when, str(e["root"]), e.get("owner") or "-")
    out_console.print(table)


def add_data_commands(parser: argparse.ArgumentParser) -> None:
    """Add ``put`` and ``ls`` under ``data``.

    ``--coordinator`` and the TLS and token flags are accepted before or after the
    subcommand.
    """
    sub = parser.add_subparsers(dest="data_command", required=True, metavar="COMMAND")

    p = add_client_command(
        sub, "put", "upload an .npz or .npy directory to the coordinator's data root", cmd_put
    )
    p.add_argument(
        "file",
        help=".npz with x [N, ...] and y of any numeric dtype (optionally x_test, y_test), or "
        "ids and strengths; a directory of x.npy, y.npy, ... (sent as an uncompressed .npz); "
        "or a .pt state dict (stored as NAME.pt, for init: {dataset: NAME})",
    )
    p.add_argument(
        "--name",
        help="name to store it as NAME.npz ([A-Za-z0-9][A-Za-z0-9._-]*; default: the file's stem)",
    )
    p.add_argument("--replace", action="store_true", help="overwrite a data set of that name")
    p.add_argument("--json", action="store_true", help="print one JSON document")

    ls = add_client_command(sub, "ls", "list the data sets in the coordinator's data roots", cmd_ls)
    ls.add_argument("--json", action="store_true", help="print a JSON list")
