"""``bench_learner --quick`` runs end to end, so ``make bench-learner`` cannot rot.

A subprocess (the benchmark configures logging for its in-process daemons, which must not
leak into this test process): all five parts at small sizes (training: one seed to test
accuracy 0.3; gpt: one seed, one epoch of 9 steps on random characters), every table
printed, and the figures that are exact whatever the machine's speed: the top-k equal to the
reference after every iteration, no memory lost, no convergence lost to the kill.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# Five parts with daemons as processes and torch children: minutes on a busy 2-core machine.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(480)]

REPO = Path(__file__).resolve().parents[2]


def test_bench_learner_quick_prints_its_five_tables(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    chars = tmp_path / "chars.npz"  # the GPT part's data: 960 rows of random characters
    np.savez(chars, x=np.random.default_rng(0).integers(0, 97, (960, 65), dtype=np.int64))

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.benchmarks.bench_learner",
            "--quick",
            "--out",
            str(out),
            "--gpt-data",
            str(chars),
            "--target-loss",
            "10",  # above a random model's ln(97) = 4.57: reached at the first evaluation
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=420,
    )

    assert done.returncode == 0, done.stderr[-4000:]
    report = out.read_text()
    for title in ("### 1. Scale", "### 2. Distributed", "### 3. Fault tolerance"):
        assert title in report
    assert report.count("| top-k rank order equal to the reference | 8/8 iterations |") == 2
    assert "| memories lost (count after the last iteration) | 0 |" in report
    assert "| memories lost, % | 0.000 |" in report
    assert "| convergence degradation, % (last iteration) | 0.000 |" in report
    assert "| GPU (during the job) |" in report
    assert "### 4. Training" in report
    assert "### 5. Training: the GPT example" in report
    assert report.count("| prioritized | 1/1 |") == 2 and report.count("| uniform | 1/1 |") == 2
