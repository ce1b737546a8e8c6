"""The real ``neuroshard data put|ls`` commands (subprocesses) against an in-process
coordinator: output, exit codes, and the file they leave (or not) in the data root."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import numpy as np
import pytest

from tests.integration.cli_helpers import run_cli

pytestmark = pytest.mark.integration


async def cli(*args: str):
    return await asyncio.to_thread(run_cli, *args)


async def test_put_then_ls(make_cluster, tmp_path: Path) -> None:
    cluster = await make_cluster(workers=0)
    at = ("--coordinator", cluster.address)
    src = tmp_path / "blobs.npz"
    np.savez(src, x=np.ones((10, 3), np.float32), y=np.arange(10, dtype=np.int64) % 2)
    root = cluster.coordinator.cfg.dataset_roots()[0]

    put = await cli("data", "put", str(src), "--name", "tiny", "--json", *at)
    again = await cli("data", "put", str(src), "--name", "tiny", *at)
    human = await cli("data", *at, "put", str(src), "--name", "tiny", "--replace")
    listed = await cli("data", "ls", "--json", *at)

    assert put.returncode == 0, put.stderr
    doc = json.loads(put.stdout)
    assert (doc["name"], doc["path"], doc["kind"], doc["bytes"]) == (
        "tiny",
        "tiny.npz",
        "train",
        src.stat().st_size,
    )
    assert again.returncode == 1
    assert again.stderr.strip() == "error: tiny.npz exists; pass --replace to overwrite it"
    assert human.returncode == 0, human.stderr
    assert human.stdout.splitlines()[0].startswith(f"stored tiny.npz: {doc['bytes']} bytes")
    assert "use it in a train job as  data: {path: tiny.npz}" in human.stdout
    assert listed.returncode == 0, listed.stderr
    assert [(e["path"], e["root"]) for e in json.loads(listed.stdout)] == [("tiny.npz", 0)]
    assert os.listdir(root) == ["tiny.npz"]


async def test_bad_input_exits_2_and_stores_nothing(make_cluster, tmp_path: Path) -> None:
    cluster = await make_cluster(workers=0)
    at = ("--coordinator", cluster.address)
    src = tmp_path / "ok.npz"
    np.savez(src, x=np.ones((10, 3), np.float32), y=np.arange(10, dtype=np.int64) % 2)
    (tmp_path / "junk.npz").write_bytes(b"not an archive")

    missing = await cli("data", "put", str(tmp_path / "nope.npz"), *at)
    bad_name = await cli("data", "put", str(src), "--name", "../up", *at)
    junk = await cli("data", "put", str(tmp_path / "junk.npz"), *at)

    assert (missing.returncode, missing.stderr.strip()) == (
        2,
        f"error: {tmp_path / 'nope.npz'}: no such file",
    )
    assert bad_name.returncode == 2 and bad_name.stderr.startswith("error: name: '../up'")
    assert junk.returncode == 2 and "junk.npz: not a readable .npz archive" in junk.stderr
    assert not cluster.coordinator.cfg.dataset_roots()[0].exists() or not os.listdir(
        cluster.coordinator.cfg.dataset_roots()[0]
    )
