"""``neuroshard memory ...``: load, get, reinforce, decay, stats and top-k from the command line.

Sample and set-strengths are in ``shared/cli/memory_replay.py``.
Input files are read and validated whole before anything is sent (``shared.memory.files``);
a bad file or argument exits 2 with one line naming the file and array (or the argument), and
so does a request the cluster refuses as INVALID_ARGUMENT (``shared.cli.main``).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from shared.cli.security import add_client_command, client_security_of

EXIT_OK, EXIT_USAGE = 0, 2
LOAD_BATCH = 100_000
Command = Callable[[argparse.Namespace], int]


class _UsageError(ValueError):
    """A bad argument; the message names it."""


def _usage_errors(command: Command) -> Command:
    """Print a bad file or argument as one line and exit 2.

    Turns the memory file readers' ``MemoryFileError`` and this module's ``_UsageError`` into
    the CLI's usage exit code without making the readers depend on the CLI.
    """

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        from shared.memory.files import MemoryFileError

        try:
            return command(args)
        except (MemoryFileError, _UsageError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USAGE

    return run


def _uint64(text: str, what: str) -> int:
    """Parse a command-line id or k; _UsageError naming ``what`` unless it is a uint64."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**64:
        raise _UsageError(f"{what}: {text!r} is not an unsigned 64-bit integer")
    return value


@_usage_errors
def cmd_load(args: argparse.Namespace) -> int:
    """Upsert the memories of an .npz (ids, strengths) in batches, with a progress bar."""
    from shared.cli.output import memories_bar
    from shared.client import SyncClient
    from shared.memory.files import load_memories

    if args.batch < 1:
        raise _UsageError(f"--batch: {args.batch} must be >= 1")
    ids, strengths = load_memories(args.file)
    t0 = time.perf_counter()
    security = client_security_of(args)
    with (
        SyncClient(args.coordinator, security=security) as client,
        memories_bar("loading", len(ids)) as advance,
    ):
        for start in range(0, len(ids), args.batch):
            end = min(start + args.batch, len(ids))
            client.upsert(ids[start:end], strengths[start:end], table=args.table)
            advance(end - start)
    seconds = time.perf_counter() - t0
    rate = len(ids) / seconds if seconds > 0 else 0.0
    print(f"loaded {len(ids)} memories from {args.file} in {seconds:.2f} s ({rate:.0f}/s)")
    return EXIT_OK


@_usage_errors
def cmd_get(args: argparse.Namespace) -> int:
    """Print id, found and strength of each id asked for."""
    from shared.client import SyncClient

    ids = np.array([_uint64(t, "id") for t in args.ids], np.uint64)
    with SyncClient(args.coordinator, security=client_security_of(args)) as client:
        found, strengths, _ = client.get(ids, table=args.table)
    rows = [
        {"id": int(i), "found": bool(f), "strength": float(s) if f else None}
        for i, f, s in zip(ids.tolist(), found.tolist(), strengths.tolist(), strict=True)
    ]
    if args.json:
        print(json.dumps(rows))
        return EXIT_OK
    for r in rows:
        strength = f"{r['strength']:.6f}" if r["found"] else "-"
        print(f"{r['id']}\t{'found' if r['found'] else 'missing'}\t{strength}")
    return EXIT_OK


@_usage_errors
def cmd_reinforce(args: argparse.Namespace) -> int:
    """Apply the .npz (ids, boosts) as one reinforce batch (duplicate ids add up)."""
    from shared.client import SyncClient
    from shared.memory.files import load_reinforcements

    ids, boosts = load_reinforcements(args.file)
    with SyncClient(args.coordinator, security=client_security_of(args)) as client:
        found = client.reinforce(ids, boosts, table=args.table)
    print(f"reinforced {found} of {len(ids)} accesses ({len(ids) - found} ids not stored)")
    return EXIT_OK


@_usage_errors
def cmd_decay(args: argparse.Namespace) -> int:
    """Decay every memory by RATE (clipped to 0)."""
    from shared.client import SyncClient

    try:
        rate = float(args.rate)
    except ValueError:
        raise _UsageError(f"rate: {args.rate!r} is not a number") from None
    with SyncClient(args.coordinator, security=client_security_of(args)) as client:
        n = client.decay(rate, table=args.table)
    print(f"decayed {n} memories by {rate:g}")
    return EXIT_OK


@_usage_errors
def cmd_stats(args: argparse.Namespace) -> int:
    """Quality statistics of all strengths and the slot figures of the cluster."""
    from shared.client import SyncClient

    with SyncClient(args.coordinator, security=client_security_of(args)) as client:
        quality = client.quality(args.table)
        status = client.status()
    doc = {
        "table": args.table,
        "memories": quality["count"],
        "quality": quality,
        "slots": status["slots"],
        "slot_map_epoch": status["slot_map_epoch"],
        "replication_factor": status["replication_factor"],
        "under_replicated_slots": status["under_replicated_slots"],
        "workers": [
            {k: w[k] for k in ("name", "state", "memories", "slots_primary", "slots_replica")}
            for w in status["workers"]
        ],
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _print_stats(doc)
    return EXIT_OK


def _print_stats(doc: dict[str, Any]) -> None:
    """Print ``memory stats`` for people: strength figures, histogram, slots, workers."""
    from shared.cli.output import out_console, print_workers, slot_figures

    q = doc["quality"]
    out_console.print(
        f"memories: {q['count']}  mean {q['mean']:.4f}  min {q['min']:.4f}  max {q['max']:.4f}"
    )
    hist = "  ".join(f"{i / 10:.1f}+: {c}" for i, c in enumerate(q["histogram"]))
    out_console.print(f"histogram: {hist}")
    out_console.print(slot_figures(doc))
    print_workers(
        doc["workers"],
        [
            ("worker", "name"),
            ("state", "state"),
            ("memories held", "memories"),
            ("primary slots", "slots_primary"),
            ("replica slots", "slots_replica"),
        ],
    )


@_usage_errors
def cmd_topk(args: argparse.Namespace) -> int:
    """The K strongest memories, strongest first (ties: smaller id)."""
    from shared.client import SyncClient

    k = _uint64(args.k, "k")
    with SyncClient(args.coordinator, security=client_security_of(args)) as client:
        ids, strengths = client.topk(k, args.table)
    top = [
        {"id": int(i), "strength": float(s)}
        for i, s in zip(ids.tolist(), strengths.tolist(), strict=True)
    ]
    if args.json:
        print(json.dumps({"k": k, "topk": top}))
        return EXIT_OK
    for rank, t in enumerate(top, start=1):
        print(f"{rank}\t{t['id']}\t{t['strength']:.6f}")
    return EXIT_OK


def add_memory_commands(parser: argparse.ArgumentParser) -> None:
    """Add ``load``, ``get``, ``reinforce``, ``decay``, ``stats`` and ``topk`` under ``memory``.

    ``--coordinator`` and the TLS and token flags are accepted before or after the
    subcommand.
    """
    sub = parser.add_subparsers(dest="memory_command", required=True, metavar="COMMAND")

    ld = add_client_command(
        sub, "load", "upsert memories from an .npz (arrays ids, strengths)", cmd_load
    )
    ld.add_argument("file", help=".npz with ids [N] uint64 and strengths [N] float32 in [0, 1]")
    ld.add_argument(
        "--batch",
        type=int,
        default=LOAD_BATCH,
        help=f"memories per upsert call (default {LOAD_BATCH})",
    )

    g = add_client_command(sub, "get", "print id, found and strength of memories", cmd_get)
    g.add_argument("ids", nargs="+", metavar="ID", help="memory id (unsigned 64-bit)")
    g.add_argument("--json", action="store_true", help="print a JSON list")

    r = add_client_command(
        sub, "reinforce", "reinforce from an .npz (arrays ids, boosts)", cmd_reinforce
    )
    r.add_argument("file", help=".npz with ids [K] uint64 and boosts [K] float32 >= 0")

    d = add_client_command(
        sub, "decay", "subtract RATE from every strength (clipped to 0)", cmd_decay
    )
    d.add_argument("rate", metavar="RATE", help="a number in [0, 1]")

    s = add_client_command(sub, "stats", "strength statistics and slot figures", cmd_stats)
    s.add_argument("--json", action="store_true", help="print one JSON document")

    t = add_client_command(sub, "topk", "the K strongest memories", cmd_topk)
    t.add_argument("k", metavar="K", help="how many (1 .. the coordinator's topk_max)")
    t.add_argument("--json", action="store_true", help="print one JSON document")

    from shared.cli.memory_io import add_memory_io_commands
    from shared.cli.memory_replay import add_replay_commands

    add_memory_io_commands(sub)
    add_replay_commands(sub)
    for command in (ld, g, r, d, s, t):
        add_table_flag(command)


def add_table_flag(parser: argparse.ArgumentParser) -> None:
    """Add ``--table NAME`` (default ``default``): the replay table a command works on."""
    parser.add_argument(
        "--table", default="default", metavar="NAME", help="the replay table (default: default)"
    )
