"""Checkpoint files: the step and the state round trip, a rewrite replaces, nothing left over."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.training import checkpoints
from coordinator.training.checkpoints import read_checkpoint, write_checkpoint
from shared import private_files


def test_checkpoint_round_trips_and_is_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "checkpoints" / "job.ckpt"
    assert read_checkpoint(path) is None

    write_checkpoint(path, 40, b"state-40")
    write_checkpoint(path, 60, b"s60")

    assert read_checkpoint(path) == (60, b"s60")
    assert path.read_bytes()[:8] == (60).to_bytes(8, "little")  # the layout resumes rely on
    assert sorted(p.name for p in path.parent.iterdir()) == ["job.ckpt"]


def test_checkpoints_and_models_are_private_whatever_the_umask(tmp_path: Path) -> None:
    import os

    from torch import nn

    from coordinator.training.checkpoints import save_model

    old = os.umask(0o022)
    try:
        write_checkpoint(tmp_path / "checkpoints" / "job.ckpt", 1, b"state")
        save_model(nn.Linear(2, 2), tmp_path / "models" / "job.pt")
    finally:
        os.umask(old)

    modes = {
        p.relative_to(tmp_path).as_posix(): oct(p.stat().st_mode & 0o777)
        for p in tmp_path.rglob("*")
    }
    assert modes == {
        "checkpoints": "0o700",
        "checkpoints/job.ckpt": "0o600",
        "models": "0o700",
        "models/job.pt": "0o600",
    }


def test_a_checkpoint_is_written_by_write_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The daemons' one atomic whole-file write (shared/private_files.py); a checkpoint
    # written another way again (its own tmp, fsync, rename) fails here.
    written: list[Path] = []

    def recording(path: Path, data: object) -> None:
        written.append(path)
        private_files.write_private(path, data)  # type: ignore[arg-type]

    monkeypatch.setattr(checkpoints, "write_private", recording)

    write_checkpoint(tmp_path / "checkpoints" / "job.ckpt", 3, b"state")

    assert written == [tmp_path / "checkpoints" / "job.ckpt"]
    assert read_checkpoint(written[0]) == (3, b"state")
