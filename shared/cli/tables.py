"""``neuroshard table ...``: create, list and drop replay tables.

A refused parameter exits 2 with the coordinator's one line naming the field (INVALID_ARGUMENT,
``shared.cli.main``); an unknown table exits 1 naming it (NOT_FOUND).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from shared.cli.security import add_client_command, client_security_of

EXIT_OK = 0


def cmd_create(args: argparse.Namespace) -> int:
    """Create a replay table and print it."""
    from shared.client import SyncClient

    with SyncClient(args.coordinator, security=client_security_of(args)) as client:
        doc = client.create_table(
            args.name, args.capacity, args.eviction, args.max_payload_bytes, args.forget_below
        )
    print(json.dumps(doc) if args.json else f"created table {_describe(doc)}")
    return EXIT_OK


def cmd_ls(args: argparse.Namespace) -> int:
    """List the replay tables, "default" first."""
    from shared.client import SyncClient

    with SyncClient(args.coordinator, security=client_security_of(args)) as client:
        tables = client.list_tables()
    if args.json:
        print(json.dumps(tables))
        return EXIT_OK
    print("name\tcapacity\teviction\tmax_payload_bytes\tforget_below")
    for t in tables:
        capacity = "unlimited" if t["capacity"] is None else t["capacity"]
        forget = "-" if t["forget_below"] is None else t["forget_below"]
        print(f"{t['name']}\t{capacity}\t{t['eviction']}\t{t['max_payload_bytes']}\t{forget}")
    return EXIT_OK


def cmd_drop(args: argparse.Namespace) -> int:
    """Drop a replay table and every memory of it."""
    from shared.client import SyncClient

    with SyncClient(args.coordinator, security=client_security_of(args)) as client:
        client.drop_table(args.name)
    print(f"dropped table {args.name}")
    return EXIT_OK


def _describe(t: dict[str, Any]) -> str:
    capacity = "unlimited" if t["capacity"] is None else f"capacity {t['capacity']}"
    forget = "" if t["forget_below"] is None else f", forget_below {t['forget_below']}"
    return (
        f"{t['name']} ({capacity}, eviction {t['eviction']}, "
        f"max_payload_bytes {t['max_payload_bytes']}{forget})"
    )


def add_table_commands(parser: argparse.ArgumentParser) -> None:
    """Add ``create``, ``ls`` and ``drop`` under ``neuroshard table``."""
    sub = parser.add_subparsers(dest="table_command", required=True, metavar="COMMAND")
    c = add_client_command(sub, "create", "create a replay table (admin)", cmd_create)
    c.add_argument("name", metavar="NAME", help="[a-z0-9][a-z0-9_-]*, at most 64 characters")
    c.add_argument(
        "--capacity", type=int, default=0, help="most memories it holds (default 0: unlimited)"
    )
    c.add_argument(
        "--eviction",
        default="fifo",
        help="what an insert into a full table evicts: fifo (oldest insert) or weakest "
        "(lowest strength, ties by smaller id); default fifo",
    )
    c.add_argument(
        "--max-payload-bytes",
        type=int,
        default=0,
        help="largest payload of one memory, bytes (default 0: the cluster's)",
    )
    c.add_argument(
        "--forget-below",
        type=float,
        default=None,
        help="a decay removes memories it leaves at or below this strength, in [0, 1)",
    )
    c.add_argument("--json", action="store_true", help="print one JSON document")
    ls = add_client_command(sub, "ls", "list the replay tables", cmd_ls)
    ls.add_argument("--json", action="store_true", help="print a JSON list")
    d = add_client_command(sub, "drop", "drop a replay table and its memories (admin)", cmd_drop)
    d.add_argument("name", metavar="NAME")
