"""Write the README's example data sets as ``.npz`` files a train job reads.

``python -m examples.prepare chars|digits32|diabetes|all [-o FILE | --out-dir D]``:

- ``chars.npz``: ``x`` [N, block + 1] int64 characters of Debian's ``fortunes`` text (fetched
  without root, ``examples.debian_text``; ``--text FILE`` takes any UTF-8 file instead), cut
  into consecutive non-overlapping rows; a language-model job reads ``x[:, :-1]`` and is
  scored on ``x[:, 1:]``. The vocabulary is fixed (``VOCAB`` = 97 ids, ``CHARS``): newline,
  the 95 printable ASCII characters, and one id for every other character (a tab is a space);
- ``digits32.npz``: scikit-learn's bundled handwritten digits (1797 8x8 images), scaled to
  [0, 1], upsampled bilinearly to 32x32, repeated over 3 channels and standardised:
  ``x`` [1797, 3, 32, 32] float32, ``y`` [1797] int64 labels 0..9;
- ``diabetes.npz``: scikit-learn's bundled diabetes data (442 patients, 10 features, a
  disease-progression score a year later), both standardised: ``x`` [442, 10] float32,
  ``y`` [442] float32.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

# Token ids: 0 newline, 1..95 the printable ASCII characters ' '..'~', 96 any other.
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
UNKNOWN = len(CHARS)
VOCAB = UNKNOWN + 1
_IDS = {ch: i for i, ch in enumerate(CHARS)} | {"\t": CHARS.index(" ")}


def encode(text: str) -> npt.NDArray[np.int64]:
    """Characters to token ids: [L] int64 in [0, VOCAB) for a text of L characters."""
    return np.fromiter((_IDS.get(ch, UNKNOWN) for ch in text), np.int64, len(text))


def decode(tokens: npt.ArrayLike) -> str:
    """Token ids back to text; the id of other characters reads as ``?``."""
    return "".join(CHARS[i] if i < UNKNOWN else "?" for i in np.asarray(tokens).ravel())


def char_rows(text: str, block: int = 64) -> dict[str, npt.NDArray[np.int64]]:
    """A language-model data set of ``text``: ``x`` [N, block + 1] int64, N = L // (block + 1).

    Consecutive non-overlapping rows of ``block + 1`` characters (the last partial row is
    dropped): the model reads the first ``block`` and predicts the last ``block``.

    Raises:
        ValueError: the text is shorter than one row.
    """
    tokens = encode(text)
    n = len(tokens) // (block + 1)
    if n < 1:
        raise ValueError(f"a text of {len(tokens)} characters holds no row of {block + 1}")
    return {"x": tokens[: n * (block + 1)].reshape(n, block + 1)}


def digits32() -> dict[str, npt.NDArray[np.generic]]:
    """Scikit-learn's digits as 3-channel 32x32 images.

    Returns:
        ``x`` [1797, 3, 32, 32] float32 (standardised over the set), ``y`` [1797] int64.
    """
    import torch
    from sklearn.datasets import load_digits

    bunch = load_digits()
    small = torch.from_numpy((bunch.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8))
    big = torch.nn.functional.interpolate(small, size=(32, 32), mode="bilinear")
    x = big.repeat(1, 3, 1, 1).numpy()
    x = (x - x.mean()) / x.std()
    return {"x": x.astype(np.float32), "y": bunch.target.astype(np.int64)}


def diabetes() -> dict[str, npt.NDArray[np.float32]]:
    """Scikit-learn's diabetes data, features and target standardised (mean 0, std 1).

    Returns:
        ``x`` [442, 10] float32, ``y`` [442] float32.
    """
    from sklearn.datasets import load_diabetes

    bunch = load_diabetes()
    x, y = bunch.data, bunch.target
    return {
        "x": ((x - x.mean(0)) / x.std(0)).astype(np.float32),
        "y": ((y - y.mean()) / y.std()).astype(np.float32),
    }


Arrays = dict[str, npt.NDArray[Any]]


def _chars(args: argparse.Namespace) -> Arrays:
    if args.text:
        text = Path(args.text).read_text(encoding="utf-8", errors="replace")
    else:
        from examples.debian_text import fortunes_text

        text = fortunes_text()
    return char_rows(text, args.block)


MAKERS: dict[str, Callable[[argparse.Namespace], Arrays]] = {
    "chars": _chars,
    "digits32": lambda _args: digits32(),
    "diabetes": lambda _args: diabetes(),
}


def main(argv: list[str] | None = None) -> int:
    """Write one example data set (or ``all`` of them); print each file's arrays."""
    p = argparse.ArgumentParser(prog="python -m examples.prepare", description=__doc__)
    p.add_argument("what", choices=[*MAKERS, "all"])
    p.add_argument("-o", "--output", help="the .npz to write (default: WHAT.npz in --out-dir)")
    p.add_argument("--out-dir", default=".", help="where the files go (default: here)")
    p.add_argument("--text", help="chars: a UTF-8 text file instead of Debian's fortunes")
    p.add_argument("--block", type=int, default=64, help="chars: positions the model reads")
    args = p.parse_args(argv)
    names = list(MAKERS) if args.what == "all" else [args.what]
    if args.output and len(names) > 1:
        p.error("-o names one file; use --out-dir with all")
    for name in names:
        arrays = MAKERS[name](args)
        out = Path(args.output or Path(args.out_dir) / f"{name}.npz")
        out.parent.mkdir(parents=True, exist_ok=True)
        np.savez(out, **arrays)  # type: ignore[arg-type]  # numpy's stub types allow_pickle
        shapes = ", ".join(f"{k} {list(v.shape)} {v.dtype}" for k, v in arrays.items())
        print(f"{out}: {shapes}", file=sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
