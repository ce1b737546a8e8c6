"""Fixtures of the CLI tests: a real ``neuroshard up`` cluster in a subprocess."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.cli_helpers import CLI, REPO, processes_mentioning


@pytest.fixture(scope="module")
def up_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """``neuroshard up --workers 3 --port 0``, one per test module: yields (address, data dir).

    Stopped with SIGINT on teardown; fails if a daemon outlives it.
    """
    data_dir = tmp_path_factory.mktemp("up")
    proc = subprocess.Popen(
        [*CLI, "up", "--workers", "3", "--port", "0", "--data-dir", str(data_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()  # printed once every worker is ALIVE
        assert address, "neuroshard up exited before printing its address"
        yield address, data_dir
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while processes_mentioning(str(data_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_mentioning(str(data_dir)) == [], "up left daemons running"
