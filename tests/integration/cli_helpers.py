"""Run the real ``neuroshard`` CLI in a subprocess, and find daemons left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "shared.cli"]


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``neuroshard ARGS...`` from the repository root; capture stdout and stderr."""
    return subprocess.run(
        [*CLI, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def processes_mentioning(text: str) -> list[int]:
    """Pids (other than ours) whose command line contains ``text``."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(proc.name))
    return pids
