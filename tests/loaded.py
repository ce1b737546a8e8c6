"""Run tests again and again under CPU burners, keeping every run's output and logs.

``make test-loaded`` (issue 20 #2): the failover, partition, durability, decay-once,
resume, forget and invariant integration tests, ``--runs`` times, each under ``--burners``
busy processes, each run with its own ``--basetemp`` (the daemons' data and logs) and its
pytest output kept under ``--out``. ``make test-restart-loop`` (issue 20 #1): the chaos test
that kill -9s every process and restarts the cluster, with the outcome of its first dump
after the status said replication factor 2 (``first_dump.txt``) tallied.

Prints one line per run and a summary ``N passed, N failed``; exit status 1 when a run
failed. Burners are killed on exit, whatever happens.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

LOADED_TESTS = [
    "tests/integration/test_failover.py",
    "tests/integration/test_failover_reports.py",
    "tests/integration/test_flapping.py",
    "tests/integration/test_partition.py",
    "tests/integration/test_durability.py",
    "tests/integration/test_decay_once.py",
    "tests/integration/test_memory_job_resume.py",
    "tests/integration/test_forget_worker.py",
    "tests/integration/test_invariant.py",
]
RESTART_TEST = "tests/chaos/test_chaos.py::test_full_cluster_restart_loses_no_acknowledged_write"


def _burn(stop_at: float, parent: int) -> None:
    """Keep one core busy until ``stop_at`` (time.monotonic seconds) or the parent is gone."""
    x = 0
    while time.monotonic() < stop_at and os.getppid() == parent:
        for _ in range(100_000):
            x = (x * 1103515245 + 12345) % 2**31


def _run(tests: list[str], markers: str, basetemp: Path, log: Path) -> int:
    """One pytest run with its own basetemp; its output into ``log``; its exit code."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-m", markers]
    cmd += ["--basetemp", str(basetemp), *tests]
    with log.open("w") as out:
        return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False).returncode


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, start the burners, run, tally; exit 1 when a run failed."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["loaded", "restart"])
    p.add_argument("--runs", type=int, default=10, help="repetitions (default 10)")
    p.add_argument("--burners", type=int, default=2, help="busy processes (default 2)")
    p.add_argument("--out", help="where runs are kept (default: a new temporary directory)")
    args = p.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix=f"neuroshard-{args.mode}-"))
    out.mkdir(parents=True, exist_ok=True)
    tests, markers = (
        (LOADED_TESTS, "not chaos")
        if args.mode == "loaded"
        else (
            [RESTART_TEST],
            "chaos",
        )
    )
    burners = [
        mp.Process(target=_burn, args=(time.monotonic() + 6 * 3600, os.getpid()), daemon=True)
        for _ in range(args.burners)
    ]
    # SIGTERM ends the runs through the finally below (the burners also stop on their own
    # once this process is gone).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for b in burners:
        b.start()
    results: Counter[str] = Counter()
    first_dumps: Counter[str] = Counter()
    try:
        for i in range(args.runs):
            start = time.monotonic()
            code = _run(tests, markers, out / f"run-{i:03d}", out / f"run-{i:03d}.log")
            results["passed" if code == 0 else "failed"] += 1
            line = f"run {i}: {'passed' if code == 0 else f'FAILED (exit {code})'}"
            found = {f.resolve() for f in (out / f"run-{i:03d}").glob("*/first_dump.txt")}
            for f in sorted(found):
                outcome = f.read_text().strip()
                first_dumps[outcome.split(":")[0]] += 1
                line += f", first dump after RF 2: {outcome}"
            print(f"{line}, {time.monotonic() - start:.0f} s", flush=True)
    finally:
        for b in burners:
            b.kill()
    if first_dumps:
        print("first dumps after RF 2: " + ", ".join(f"{k} {v}" for k, v in first_dumps.items()))
    print(f"kept in {out}")
    print(f"{results['passed']} passed, {results['failed']} failed")
    return 1 if results["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
