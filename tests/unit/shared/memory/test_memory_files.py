"""Memory input files: arrays read back, and one-line errors naming the file and array."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shared.memory.files import (
    MemoryFileError,
    load_memories,
    load_reinforcements,
    load_trace,
)


def test_valid_files_round_trip(tmp_path: Path) -> None:
    np.savez(tmp_path / "m.npz", ids=np.arange(3), strengths=[0.0, 0.5, 1.0], extra=[1])
    np.savez(tmp_path / "r.npz", ids=np.array([2, 2], np.uint32), boosts=[0.1, 0.2])
    np.save(tmp_path / "t2.npy", np.arange(12, dtype=np.int64).reshape(4, 3))
    np.save(tmp_path / "t1.npy", np.arange(5, dtype=np.uint64))

    ids, strengths = load_memories(tmp_path / "m.npz")
    r_ids, boosts = load_reinforcements(tmp_path / "r.npz")
    trace = load_trace(tmp_path / "t2.npy", iterations=2)

    assert ids.dtype == r_ids.dtype == trace.dtype == np.uint64
    assert strengths.dtype == boosts.dtype == np.float32
    assert strengths.tolist() == [0.0, 0.5, 1.0] and r_ids.tolist() == [2, 2]
    assert trace.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert load_trace(tmp_path / "t1.npy", iterations=9).shape == (1, 5)


def _save_cases(d: Path) -> None:
    np.savez(d / "bad_s.npz", ids=np.arange(3), strengths=[0.1, 1.5, 0.2])
    np.savez(d / "no_s.npz", ids=np.arange(3), values=np.ones(3))
    np.savez(d / "len.npz", ids=np.arange(3), strengths=np.ones(2))
    np.savez(d / "neg_b.npz", ids=np.arange(2), boosts=[0.1, -0.2])
    np.savez(d / "obj.npz", ids=np.array([1, "a"], object), strengths=np.ones(2))
    np.save(d / "neg.npy", np.array([[1, 2], [3, -4]]))
    np.save(d / "neg1.npy", np.array([1, -2]))
    np.save(d / "floats.npy", np.ones((2, 2)))
    np.save(d / "cube.npy", np.zeros((1, 1, 1), np.uint64))
    np.save(d / "empty.npy", np.zeros((2, 0), np.uint64))
    (d / "text.npz").write_text("ids,strengths\n")


@pytest.mark.parametrize(
    ("load", "name", "message"),
    [
        (load_memories, "bad_s.npz", "strengths[1]: 1.5 is outside [0, 1]"),
        (load_memories, "no_s.npz", "no array 'strengths' (has: ids, values)"),
        (load_memories, "len.npz", "ids and strengths differ in length (3 != 2)"),
        (load_memories, "obj.npz", "array 'ids': Object arrays cannot be loaded"),
        (load_memories, "text.npz", "not a .npz file (as np.savez writes)"),
        (load_memories, "missing.npz", "no such file"),
        (load_memories, "neg.npy", "expected an .npz archive of arrays, got a single array"),
        (load_reinforcements, "neg_b.npz", "boosts[1]: -0.2 is negative"),
        (load_trace, "neg.npy", "trace[1, 1]: -4 is negative; ids are uint64"),
        (load_trace, "neg1.npy", "trace[1]: -2 is negative; ids are uint64"),
        (load_trace, "floats.npy", "trace: dtype float64 is not an integer type"),
        (load_trace, "cube.npy", "trace must be 1-D [batch] or 2-D [iterations, batch]"),
        (load_trace, "empty.npy", "trace has no ids (shape (2, 0))"),
        (load_trace, "bad_s.npz", "expected one .npy array of ids, got an .npz archive"),
    ],
)
def test_bad_files_name_the_file_and_array(tmp_path: Path, load, name: str, message: str) -> None:
    _save_cases(tmp_path)
    args = (tmp_path / name, 2) if load is load_trace else (tmp_path / name,)
    with pytest.raises(MemoryFileError) as info:
        load(*args)
    text = str(info.value)
    assert text.startswith(f"{tmp_path / name}: ") and message in text and "\n" not in text


def test_trace_with_too_few_rows(tmp_path: Path) -> None:
    np.save(tmp_path / "t.npy", np.zeros((2, 3), np.uint64))
    with pytest.raises(MemoryFileError, match="trace has 2 rows but the job runs 3 iterations"):
        load_trace(tmp_path / "t.npy", iterations=3)
