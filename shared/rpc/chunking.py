"""Cutting a run of items into messages of about a byte budget each.

Bulk streams (slot copies, the store's export, an import's upserts) send memories whose size
varies with their payloads: cutting by item count alone lets payload-heavy runs overflow
the gRPC message limit, so they are cut by bytes, payloads counted.

Shape letters: N items.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

BYTES_PER_MEMORY = 12  # uint64 id + float32 strength, without a payload


def byte_ranges(
    sizes: npt.NDArray[np.int64], max_bytes: int, max_items: int | None = None
) -> list[tuple[int, int]]:
    """Cut items into consecutive [start, stop) ranges of at most ``max_bytes`` each, greedily.

    A range holds at least one item, so an item larger than ``max_bytes`` goes alone.

    Args:
        sizes: [N] bytes of each item (>= 0).
        max_bytes: the budget of one range, bytes, >= 1.
        max_items: also at most this many items per range; None: no such limit.

    Returns:
        Ranges covering 0..N in order; an empty list for N = 0.
    """
    ends = np.cumsum(sizes, dtype=np.int64)
    n, cap = len(sizes), max_items or len(sizes)
    out: list[tuple[int, int]] = []
    a = 0
    while a < n:
        before = int(ends[a - 1]) if a else 0
        b = int(np.searchsorted(ends, before + max_bytes, side="right"))
        b = min(max(b, a + 1), a + cap)
        out.append((a, b))
        a = b
    return out


def memory_sizes(
    ids: npt.NDArray[np.uint64], payloads: dict[int, bytes] | None
) -> npt.NDArray[np.int64]:
    """[N] bytes of each memory on the wire: 12, plus its payload's length if it has one."""
    sizes = np.full(len(ids), BYTES_PER_MEMORY, np.int64)
    if payloads:
        where = {i: k for k, i in enumerate(ids.tolist())}
        for i, p in payloads.items():
            if i in where:
                sizes[where[i]] += len(p)
    return sizes
