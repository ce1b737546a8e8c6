"""Run the real ``neuroshard`` CLI in a subprocess, and find daemons left behind."""

from __future__ import annotations

import asyncio
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


async def start_link(target_port: int, *flags: str) -> tuple[asyncio.subprocess.Process, str]:
    """Start ``neuroshard link`` to ``127.0.0.1:target_port`` with ``flags``.

    Returns:
        The process and the address it printed (``--listen 127.0.0.1:0`` unless a flag
        says otherwise); the caller ends the process.
    """
    listen = [] if "--listen" in flags else ["--listen", "127.0.0.1:0"]
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        *["link", *listen, "--target", f"127.0.0.1:{target_port}", *flags],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
    )
    assert proc.stdout is not None
    address = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode().strip()
    return proc, address
