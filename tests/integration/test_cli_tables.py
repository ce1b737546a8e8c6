"""The real ``neuroshard table`` commands and ``--table`` of the memory commands, against
``neuroshard up``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.integration.cli_helpers import run_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_table_create_ls_drop_and_memory_commands_on_a_table(
    up_cluster: tuple[str, Path], tmp_path: Path
) -> None:
    address, _ = up_cluster
    at = ("--coordinator", address)
    ids = np.arange(1, 101, dtype=np.uint64)
    np.savez(tmp_path / "mem.npz", ids=ids, strengths=np.full(100, 0.5, np.float32))

    created = run_cli(
        "table", "create", "replay", "--max-payload-bytes", "64", "--forget-below", "0.1", *at
    )
    listed = run_cli("table", "ls", "--json", *at)
    loaded = run_cli("memory", "load", str(tmp_path / "mem.npz"), "--table", "replay", *at)
    got = run_cli("memory", "get", "1", "--table", "replay", *at)
    got_default = run_cli("memory", "get", "1", *at)
    stats = run_cli("memory", "stats", "--json", "--table", "replay", *at)
    for done in (created, listed, loaded, got, got_default, stats):
        assert done.returncode == 0, done.stderr
    assert created.stdout.strip() == (
        "created table replay (unlimited, eviction fifo, max_payload_bytes 64, forget_below 0.1)"
    )
    assert [t["name"] for t in json.loads(listed.stdout)] == ["default", "replay"]
    assert got.stdout.splitlines() == ["1\tfound\t0.500000"]
    assert got_default.stdout.splitlines() == ["1\tmissing\t-"]
    assert json.loads(stats.stdout)["memories"] == 100

    unknown = run_cli("memory", "get", "1", "--table", "nope", *at)
    bad = run_cli("table", "create", "x", "--eviction", "lru", *at)
    assert unknown.returncode == 1 and "table 'nope' does not exist" in unknown.stderr
    assert bad.returncode == 2 and "eviction: 'lru'" in bad.stderr

    dropped = run_cli("table", "drop", "replay", *at)
    assert dropped.returncode == 0 and dropped.stdout.strip() == "dropped table replay"
    after = run_cli("memory", "get", "1", "--table", "replay", *at)
    assert after.returncode == 1 and "table 'replay' does not exist" in after.stderr
