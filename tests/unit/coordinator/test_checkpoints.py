"""Checkpoint files: the step and the state round trip, a rewrite replaces, nothing left over."""

from __future__ import annotations

from pathlib import Path

from coordinator.checkpoints import read_checkpoint, write_checkpoint


def test_checkpoint_round_trips_and_is_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "checkpoints" / "job.ckpt"
    assert read_checkpoint(path) is None

    write_checkpoint(path, 40, b"state-40")
    write_checkpoint(path, 60, b"s60")

    assert read_checkpoint(path) == (60, b"s60")
    assert path.read_bytes()[:8] == (60).to_bytes(8, "little")  # the layout resumes rely on
    assert sorted(p.name for p in path.parent.iterdir()) == ["job.ckpt"]
