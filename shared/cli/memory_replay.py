"""``neuroshard memory sample N`` and ``neuroshard memory set-strengths FILE``: replay commands.

``sample`` draws N memories by priority (P(i) = s_i^alpha / sum_j s_j^alpha, exact over the
table, ``Client.sample``) and prints one line per draw (``--json``: one document);
``set-strengths`` sets the strengths of the memories of an .npz (ids, strengths) in one
priority update: payloads kept, ids not stored skipped and counted.

Exit codes: 0 done; 1 refused by the cluster (e.g. an empty table); 2 a bad file or argument.
"""

from __future__ import annotations

import argparse
import json
import math

from shared.cli.common import EXIT_OK, EXIT_USAGE
from shared.cli.security import add_client_command, client_security_of


def cmd_sample(args: argparse.Namespace) -> int:
    """Draw N memories by priority and print id, strength, probability (and payload size)."""
    import sys

    from shared.client import SyncClient

    if not math.isfinite(args.alpha) or args.alpha < 0:
        print(f"error: --alpha: {args.alpha} must be finite and >= 0", file=sys.stderr)
        return EXIT_USAGE
    with SyncClient(args.coordinator, security=client_security_of(args)) as client:
        batch = client.sample(
            args.n,
            alpha=args.alpha,
            seed=args.seed,
            min_size=args.min_size,
            timeout_s=args.timeout,
            table=args.table,
        )
    draws = [
        {
            "id": int(i),
            "strength": float(s),
            "probability": float(p),
            "payload_bytes": len(b or b""),
        }
        for i, s, p, b in zip(
            batch.ids.tolist(),
            batch.strengths.tolist(),
            batch.probabilities.tolist(),
            batch.payloads,
            strict=True,
        )
    ]
    if args.json:
        doc = {"seed": batch.seed, "size": batch.size, "total_weight": batch.total_weight}
        print(json.dumps({**doc, "draws": draws}))
        return EXIT_OK
    print(f"# seed {batch.seed}, table size {batch.size}, total weight {batch.total_weight}")
    for d in draws:
        print(f"{d['id']}\t{d['strength']:.6f}\t{d['probability']:.6g}\t{d['payload_bytes']}")
    return EXIT_OK


def cmd_set_strengths(args: argparse.Namespace) -> int:
    """Set the strengths of the .npz's ids (a priority update; absent ids skipped)."""
    import sys

    from shared.client import SyncClient
    from shared.memory.files import MemoryFileError, load_memories

    try:
        ids, strengths = load_memories(args.file)
    except MemoryFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    with SyncClient(args.coordinator, security=client_security_of(args)) as client:
        found = client.update_strengths(ids, strengths)
    distinct = len(set(ids.tolist()))
    print(f"updated {found} of {distinct} ids ({distinct - found} not stored, skipped)")
    return EXIT_OK


def add_replay_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``sample`` and ``set-strengths`` under ``memory``."""
    s = add_client_command(sub, "sample", "draw N memories by priority", cmd_sample)
    s.add_argument("n", type=int, metavar="N", help="draws (1 .. max_sample_batch)")
    s.add_argument("--alpha", type=float, default=0.6, help="priority exponent (default 0.6)")
    s.add_argument("--seed", type=int, default=None, help="the draws' seed (default: fresh)")
    s.add_argument(
        "--min-size", type=int, default=0, help="wait for the table to hold this many memories"
    )
    s.add_argument(
        "--timeout", type=float, default=30.0, help="seconds --min-size may wait (default 30)"
    )
    s.add_argument("--table", default="default", help="the table (default 'default')")
    s.add_argument("--json", action="store_true", help="print one JSON document")

    u = add_client_command(
        sub,
        "set-strengths",
        "set strengths from an .npz (arrays ids, strengths); payloads kept",
        cmd_set_strengths,
    )
    u.add_argument("file", help=".npz with ids [N] uint64 and strengths [N] float32 in [0, 1]")
