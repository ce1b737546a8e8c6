"""examples.prepare: the example data sets' layouts, and the fixed character vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from examples.prepare import VOCAB, char_rows, decode, diabetes, digits32, encode, main


def test_characters_map_to_a_fixed_vocabulary_of_97_ids() -> None:
    tokens = encode("Hi!\n\tz~é")

    assert VOCAB == 97
    assert tokens.tolist() == [41, 74, 2, 0, 1, 91, 95, 96]
    assert decode(tokens) == "Hi!\n z~?"


def test_char_rows_are_consecutive_windows_of_block_plus_one() -> None:
    rows = char_rows("abcdefghij", block=2)["x"]

    assert rows.shape == (3, 3) and rows.dtype == np.int64
    assert [decode(r) for r in rows] == ["abc", "def", "ghi"]


def test_a_text_shorter_than_a_row_is_refused() -> None:
    with pytest.raises(ValueError, match="holds no row of 65"):
        char_rows("short")


def test_digits32_and_diabetes_have_the_layouts_their_jobs_read() -> None:
    d, r = digits32(), diabetes()

    assert d["x"].shape == (1797, 3, 32, 32) and d["x"].dtype == np.float32
    assert d["y"].dtype == np.int64 and sorted(set(d["y"].tolist())) == list(range(10))
    assert abs(float(d["x"].mean())) < 1e-4 and abs(float(d["x"].std()) - 1) < 1e-4
    assert r["x"].shape == (442, 10) and r["y"].shape == (442,)
    assert r["x"].dtype == r["y"].dtype == np.float32
    np.testing.assert_allclose(r["x"].std(0), 1.0, rtol=1e-5)


def test_the_command_writes_chars_from_a_text_file(tmp_path: Path, capsys) -> None:
    text = tmp_path / "t.txt"
    text.write_text("hello world, " * 20)

    assert main(["chars", "--text", str(text), "--block", "8", "-o", str(tmp_path / "c.npz")]) == 0

    x = np.load(tmp_path / "c.npz")["x"]
    assert x.shape == (260 // 9, 9)
    assert "c.npz: x [28, 9] int64" in capsys.readouterr().out
