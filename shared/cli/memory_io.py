"""Operator commands: ``neuroshard memory export|import FILE.npz`` and ``forget-worker NAME``.

Export and import move a whole store through a plain ``.npz`` (backups, moving a store
between clusters; format in ``shared/memory/export_file.py``), with a progress bar on a
terminal. ``forget-worker`` without ``--yes`` changes nothing: it prints what forgetting the
worker would lose and exits 1.

Exit codes: 0 done; 1 refused or failed (e.g. forget-worker without ``--yes``, a worker that
is ALIVE); 2 a bad file or argument (the message names the file and the array).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable

from shared.cli.common import EXIT_FAILED, EXIT_OK
from shared.cli.security import add_client_command, client_security_of
from shared.memory.export_file import IMPORT_BATCH


def cmd_export(args: argparse.Namespace) -> int:
    """Write every memory of the store to FILE.npz (ids, strengths, payloads if any).

    Each slot is a point-in-time copy read from its primary; writes during the export may or
    may not be in it. The file appears only once the export completed.
    """
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from shared.cli.output import err_console
    from shared.client import SyncClient

    t0 = time.perf_counter()
    # The total is the heartbeats' count of memories (writes may change it): shown as "~".
    columns = ("exporting", BarColumn(), TextColumn("{task.fields[count]}"), TimeElapsedColumn())
    with (
        SyncClient(args.coordinator, security=client_security_of(args)) as client,
        Progress(
            *columns, console=err_console, disable=not err_console.is_terminal, transient=True
        ) as bar,
    ):
        task = bar.add_task("export", total=None, count="")

        def advance(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total, count=f"{done:,} / ~{total:,} memories")

        doc = client.export_memories(args.file, progress=advance, table=args.table)
    doc["seconds"] = round(time.perf_counter() - t0, 3)
    if args.json:
        print(json.dumps(doc))
        return EXIT_OK
    extra = f", {doc['payloads']} payload bytes" if doc["payloads"] else ""
    print(
        f"exported {doc['memories']} memories{extra} ({doc['slots']} slots) to {doc['path']} "
        f"in {doc['seconds']:.2f} s ({doc['file_bytes']} bytes)"
    )
    return EXIT_OK


def cmd_import(args: argparse.Namespace) -> int:
    """Upsert every memory of an export FILE.npz into the store.

    The whole file is checked first (a bad one writes nothing); memories already stored
    under other ids are kept. A failure part-way leaves the batches before it written:
    import the file again to complete it.
    """
    from shared.cli.common import CliError
    from shared.cli.output import memories_bar
    from shared.client import SyncClient

    if args.batch < 1:
        raise CliError(f"--batch: {args.batch} must be >= 1", 2)
    t0 = time.perf_counter()
    with (
        SyncClient(args.coordinator, security=client_security_of(args)) as client,
        contextlib.ExitStack() as stack,
    ):
        advance: list[Callable[[int], None]] = []  # the bar, once the file is checked

        def checked(n: int) -> None:
            advance.append(stack.enter_context(memories_bar("importing", n)))

        doc = client.import_memories(
            args.file, args.batch, lambda n: advance[0](n), checked, table=args.table
        )
    doc["seconds"] = round(time.perf_counter() - t0, 3)
    if args.json:
        print(json.dumps(doc))
        return EXIT_OK
    rate = doc["memories"] / doc["seconds"] if doc["seconds"] > 0 else 0.0
    payloads = " with payloads" if doc["payloads"] else ""
    print(
        f"imported {doc['memories']} memories{payloads} from {doc['path']} in "
        f"{doc['seconds']:.2f} s ({rate:.0f}/s)"
    )
    return EXIT_OK


def cmd_forget_worker(args: argparse.Namespace) -> int:
    """Forget a DEAD worker that will never return (admin).

    The slots of which it held the last trusted copy are re-created empty on live workers,
    losing their memories; its other slots keep their copy. Without --yes nothing changes:
    the command prints what would be lost and exits 1.
    """
    from shared.client import SyncClient

    with SyncClient(args.coordinator, security=client_security_of(args)) as client:
        doc = client.forget_worker(args.name, confirm=args.yes)
    if args.json:
        print(json.dumps(doc))
    else:
        print(_forget_text(doc))
    return EXIT_OK if doc["forgotten"] else EXIT_FAILED


def _forget_text(doc: dict[str, object]) -> str:
    """``forget-worker``'s report for people."""
    lost = doc["lost_slots"]
    assert isinstance(lost, list)
    memories = doc["lost_memories"]
    count = (
        f"{memories} memories (per slot, as its last heartbeat reported them)"
        if memories is not None
        else "an unknown number of memories (no heartbeat of it since the coordinator started)"
    )
    kept = f"{doc['slots_kept']} of its slots keep another trusted copy"
    if doc["forgotten"]:
        return f"forgot {doc['worker']}: {len(lost)} slots re-created empty, {count} lost; {kept}"
    return (
        f"forgetting {doc['worker']} would re-create {len(lost)} slots empty, losing {count}; "
        f"{kept}. Nothing changed: run again with --yes to forget it"
    )


def add_memory_io_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``export`` and ``import`` under ``neuroshard memory``."""
    e = add_client_command(sub, "export", "write a whole table to an .npz", cmd_export)
    e.add_argument("file", metavar="FILE.npz", help="the file to create (or replace)")
    e.add_argument("--json", action="store_true", help="print one JSON document")

    i = add_client_command(sub, "import", "upsert an export .npz into a table", cmd_import)
    i.add_argument("file", metavar="FILE.npz", help="a file written by memory export")
    i.add_argument(
        "--batch",
        type=int,
        default=IMPORT_BATCH,
        help=f"memories per upsert call (default {IMPORT_BATCH})",
    )
    i.add_argument("--json", action="store_true", help="print one JSON document")
    for command in (e, i):
        command.add_argument(
            "--table", default="default", metavar="NAME", help="the replay table (default: default)"
        )


def add_forget_worker_command(parser: argparse.ArgumentParser) -> None:
    """Give ``neuroshard forget-worker`` (a client command's parser) its arguments."""
    parser.add_argument("name", metavar="NAME", help="the worker's name")
    parser.add_argument(
        "--yes", action="store_true", help="do it (without: print what would be lost, exit 1)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.set_defaults(func=cmd_forget_worker)
