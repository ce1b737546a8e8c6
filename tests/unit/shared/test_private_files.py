"""shared/private_files.py's ``write_private``: the one atomic whole-file write of the daemons.

Data set owners, training checkpoints and journal snapshots each wrote the same temporary
file, fsync, rename and directory fsync (review finding); now they call ``write_private``.
``tests/unit/coordinator/training/test_checkpoints.py`` and
``tests/unit/worker/store/test_journal.py`` fail if one of them writes its file another way.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.private_files import write_private


def test_pieces_are_written_in_order_privately_and_replace_the_file(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")
    old = os.umask(0o022)
    try:
        write_private(path, iter([b"ab", b"", memoryview(b"cd"), b"e"]))  # type: ignore[list-item]
    finally:
        os.umask(old)

    assert path.read_bytes() == b"abcde"
    assert path.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]
    write_private(path, b"whole")
    assert path.read_bytes() == b"whole"


def test_a_write_that_fails_midway_leaves_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    write_private(path, b"old")

    def pieces() -> Iterator[bytes]:
        yield b"new"
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_private(path, pieces())

    assert path.read_bytes() == b"old"
