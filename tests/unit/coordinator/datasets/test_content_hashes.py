"""A data set is hashed once per version of its files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from coordinator.datasets import content_hashes
from coordinator.datasets.content_hashes import ContentHashes


def test_a_version_is_hashed_once_and_a_new_one_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros((4, 2), np.float32))
    calls: list[Path] = []
    real = content_hashes.content_hash
    monkeypatch.setattr(content_hashes, "content_hash", lambda p: calls.append(p) or real(p))
    hashes = ContentHashes()

    first, again = hashes.get(path), hashes.get(path)
    np.savez(path, x=np.ones((4, 2), np.float32))
    os.utime(path, ns=(1, 1))  # a new mtime even on a coarse clock
    changed = hashes.get(path)

    assert first == again != changed
    assert calls == [path, path]
