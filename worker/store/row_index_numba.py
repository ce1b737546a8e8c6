"""Compiled loops of the store's row index (``worker/store/slot_rows.py``): a hash table id -> row.

The table is open addressing with linear probing over [T] int32 cells holding a row number
(-1: empty). A key's home cell is the top log2(T) bits of the key times 2^64/phi (Fibonacci
hashing, Knuth TAOCP vol. 3, 6.4), so keys that share their top bits (the slot: the keys of
the few slots one copy imports, or of the slots one worker holds) still spread over the whole
table; the key's own top bits would pile them into the table's stretch for those slots, one
cluster of every key imported, and probes quadratic in the batch (a 131k-memory slot copy
into an empty worker took minutes). A cell is matched by comparing the id stored at its row
(``ids_buf[row]``), so the table needs no copy of the keys.

Deletion shifts later cells of the cluster back (Knuth, TAOCP vol. 3, 6.4, Algorithm R), so
there are no tombstones and probe lengths depend only on the load.

Every function here is serial and releases the GIL, as ``worker/store/kernels_numba.py``.

Shape letters: T table cells, C row capacity, M keys looked up or rows moved, S slots.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import numba
import numpy as np

F = TypeVar("F", bound=Callable[..., Any])
EMPTY = -1
FIB = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio, odd


def _njit(**options: Any) -> Callable[[F], F]:
    """``numba.njit(**options)`` typed for mypy: a compiled function keeps its signature."""
    return cast(Callable[[F], F], numba.njit(**options))


@_njit(cache=True, nogil=True)
def sort_key1(id_: np.uint64, bits: int) -> np.uint64:  # pragma: no cover - compiled
    """``shared.memory.slots.sort_key`` of one id, ``bits`` = log2(S).

    mix64 (splitmix64's finalizer), rotated right by ``bits``.
    """
    z = np.uint64(id_)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    if bits == 0:
        return z
    return (z >> np.uint64(bits)) | (z << np.uint64(64 - bits))


@_njit(cache=True, nogil=True)
def sort_keys(ids: np.ndarray, bits: int) -> np.ndarray:  # pragma: no cover - compiled
    """[M] uint64 ``sort_key`` of ids [M] uint64 (tested equal to the NumPy one)."""
    out = np.empty(ids.shape[0], np.uint64)
    for i in range(ids.shape[0]):
        out[i] = sort_key1(ids[i], bits)
    return out


@_njit(cache=True, nogil=True)
def _home(key: np.uint64, tshift: np.uint64) -> np.int64:  # pragma: no cover - compiled
    """The home cell of key: the top log2(T) bits of key * FIB (mod 2^64)."""
    return np.int64((key * FIB) >> tshift)


@_njit(cache=True, nogil=True)
def _find(  # pragma: no cover - compiled
    table: np.ndarray, tshift: np.uint64, ids_buf: np.ndarray, key: np.uint64, id_: np.uint64
) -> np.int64:
    """Cell holding id_ (whose key is key), or -1 - the empty cell that ends its probe."""
    mask = table.shape[0] - 1
    c = _home(key, tshift)
    while True:
        row = table[c]
        if row == EMPTY:
            return -1 - c
        if ids_buf[row] == id_:
            return c
        c = (c + 1) & mask


@_njit(cache=True, nogil=True)
def lookup(  # pragma: no cover - compiled
    table: np.ndarray, tshift: np.uint64, ids_buf: np.ndarray, keys: np.ndarray, ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ids [M] uint64 (keys [M] their sort keys): ``(rows [M] int64, found [M] bool)``.

    Rows are -1 where not found.
    """
    m = keys.shape[0]
    rows = np.full(m, -1, np.int64)
    found = np.zeros(m, np.bool_)
    for j in range(m):
        c = _find(table, tshift, ids_buf, keys[j], ids[j])
        if c >= 0:
            rows[j] = table[c]
            found[j] = True
    return rows, found


@_njit(cache=True, nogil=True)
def _link(  # pragma: no cover - compiled
    table: np.ndarray, tshift: np.uint64, key: np.uint64, row: int
) -> None:
    mask = table.shape[0] - 1
    c = _home(key, tshift)
    while table[c] != EMPTY:
        c = (c + 1) & mask
    table[c] = row


@_njit(cache=True, nogil=True)
def append(  # pragma: no cover - compiled
    table: np.ndarray,
    tshift: np.uint64,
    ids_buf: np.ndarray,
    base: np.ndarray,
    length: np.ndarray,
    bits: int,
    keys: np.ndarray,
    ids: np.ndarray,
) -> np.ndarray:
    """Append absent, distinct ids [M] to the ends of their slots' regions and index them.

    The caller has reserved room (``base[s] + length[s] + new <= base[s] + cap[s]``).

    Returns:
        [M] int64, the row each id was given (strengths are the caller's to write).
    """
    m = keys.shape[0]
    rows = np.empty(m, np.int64)
    for j in range(m):
        key = keys[j]
        s = 0 if bits == 0 else np.int64(key >> np.uint64(64 - bits))
        row = base[s] + length[s]
        length[s] += 1
        ids_buf[row] = ids[j]
        _link(table, tshift, key, row)
        rows[j] = row
    return rows


@_njit(cache=True, nogil=True)
def unlink(  # pragma: no cover - compiled
    table: np.ndarray, tshift: np.uint64, ids_buf: np.ndarray, bits: int, rows: np.ndarray
) -> None:
    """Remove the cells of rows [M] (indexed, distinct) from the table.

    Later cells of each cluster shift back (Algorithm R), so that no probe is broken.
    """
    mask = table.shape[0] - 1
    for j in range(rows.shape[0]):
        id_ = ids_buf[rows[j]]
        i = _find(table, tshift, ids_buf, sort_key1(id_, bits), id_)
        k = i
        while True:
            k = (k + 1) & mask
            row = table[k]
            if row == EMPTY:
                break
            home = _home(sort_key1(ids_buf[row], bits), tshift)
            # Move cell k into the hole i unless its home lies cyclically in (i, k].
            if (i <= k and (home <= i or home > k)) or (i > k and home <= i and home > k):
                table[i] = row
                i = k
        table[i] = EMPTY


@_njit(cache=True, nogil=True)
def move(  # pragma: no cover - compiled
    table: np.ndarray,
    tshift: np.uint64,
    ids_buf: np.ndarray,
    bits: int,
    src: np.ndarray,
    dst: np.ndarray,
) -> None:
    """Move the ids of rows src [M] to rows dst [M] and repoint their cells.

    No dst may be a later src (the caller's moves have no chains); strengths are the
    caller's to move.
    """
    for j in range(src.shape[0]):
        id_ = ids_buf[src[j]]
        c = _find(table, tshift, ids_buf, sort_key1(id_, bits), id_)
        table[c] = dst[j]
        ids_buf[dst[j]] = id_


@_njit(cache=True, nogil=True)
def rebuild(  # pragma: no cover - compiled
    table: np.ndarray,
    tshift: np.uint64,
    ids_buf: np.ndarray,
    bits: int,
    base: np.ndarray,
    length: np.ndarray,
) -> None:
    """Index every row of every slot's region into an emptied table, slot by slot."""
    table[:] = EMPTY
    for s in range(base.shape[0]):
        for row in range(base[s], base[s] + length[s]):
            _link(table, tshift, sort_key1(ids_buf[row], bits), row)


@_njit(cache=True, nogil=True)
def gather_regions(  # pragma: no cover - compiled
    buf: np.ndarray, base: np.ndarray, length: np.ndarray, out: np.ndarray
) -> None:
    """Copy every slot's region of buf, slot by slot, into out [sum(length)]."""
    at = 0
    for s in range(base.shape[0]):
        n = length[s]
        out[at : at + n] = buf[base[s] : base[s] + n]
        at += n
