"""Validation of memory-store input, shared by the client, the coordinator and the workers.

Each function checks a whole batch before anything is applied, so a refused batch changes
nothing, and names the field and the first offending index in its ``MemoryInputError``
(INVALID_ARGUMENT at every gRPC boundary).

Shape letters: K batch items.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "MemoryInputError",
    "as_ids",
    "as_slots",
    "validate_k",
    "validate_op_id",
    "validate_rate",
    "validate_reinforce",
    "validate_request_id",
    "validate_upsert",
    "validate_values",
]


class MemoryInputError(ValueError):
    """A memory-store request is malformed (maps to INVALID_ARGUMENT); nothing was applied."""


def _fmt(value: float | np.integer[Any] | np.floating[Any]) -> str:
    """A number as its shortest float repr, for messages (``0.1``, ``nan``, ``inf``)."""
    return repr(float(value))


def as_ids(ids: object, name: str = "ids") -> npt.NDArray[np.uint64]:
    """Return ids as a 1-D uint64 array, refusing what is not one without loss.

    Args:
        ids: [K] integers of any integer dtype (an empty array of any dtype is accepted).
        name: the field, named in errors.

    Returns:
        [K] uint64; ``ids`` itself when it is uint64 already.

    Raises:
        MemoryInputError: not 1-D, not integers, or a negative value (INVALID_ARGUMENT).
    """
    a = np.asarray(ids)
    if a.ndim != 1:
        raise MemoryInputError(f"{name}: expected a 1-D array, got shape {a.shape}")
    if a.size == 0:  # any dtype, complex too: nothing is cast
        return np.empty(0, np.uint64)
    if a.dtype == np.uint64:
        return a
    if a.dtype.kind == "i":
        negative = np.flatnonzero(a < 0)
        if len(negative):
            i = int(negative[0])
            raise MemoryInputError(f"{name}[{i}]: {a[i]} is negative; ids are uint64")
    elif a.dtype.kind != "u":
        raise MemoryInputError(f"{name}: dtype {a.dtype} is not an integer type")
    return a.astype(np.uint64)


def as_slots(slots: object, num_slots: int, name: str = "slots") -> npt.NDArray[np.int64]:
    """Return slot numbers as a 1-D int64 array, each in [0, num_slots).

    Args:
        slots: [G] integers.
        num_slots: number of slots S of the cluster.
        name: the field, named in errors.

    Raises:
        MemoryInputError: not 1-D integers, or a slot outside [0, S) (INVALID_ARGUMENT).
    """
    a = np.asarray(slots)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise MemoryInputError(f"{name}: expected a 1-D array of integers")
    a = a.astype(np.int64) if a.size else np.empty(0, np.int64)
    bad = np.flatnonzero((a < 0) | (a >= num_slots))
    if len(bad):
        i = int(bad[0])
        raise MemoryInputError(f"{name}[{i}]: {a[i]} is outside [0, {num_slots})")
    return a


def validate_values(
    values: object, name: str, ids: npt.NDArray[Any], *, unit_range: bool = False
) -> npt.NDArray[np.float32]:
    """Return values as [K] float32 matching ids: finite, >= 0, and <= 1 when unit_range.

    -0.0 becomes +0.0, so stored strengths compare equal bit for bit.

    Args:
        values: [K] numbers of any integer or float dtype.
        name: the field (``strengths``, ``boosts``), named in errors.
        ids: [K] the batch's ids, for the length check.
        unit_range: also refuse values above 1 (strengths).

    Returns:
        [K] float32, a new array.

    Raises:
        MemoryInputError: not 1-D numbers, a length other than K, or a value that is NaN,
            infinite, negative, beyond float32, or above 1 with ``unit_range``
            (INVALID_ARGUMENT).
    """
    a = np.asarray(values)
    if a.ndim != 1:
        raise MemoryInputError(f"{name}: expected a 1-D array, got shape {a.shape}")
    if a.size and a.dtype.kind not in "fiu":
        raise MemoryInputError(f"{name}: dtype {a.dtype} is not a number type")
    if len(a) != len(ids):
        raise MemoryInputError(f"ids and {name} differ in length ({len(ids)} != {len(a)})")
    if a.size == 0:
        return np.empty(0, np.float32)
    if a.dtype == np.float32:  # the usual case: two comparisons also refuse NaN and inf
        upper = np.float32(1) if unit_range else np.finfo(np.float32).max
        if np.all((a >= 0) & (a <= upper)):
            return a + np.float32(0)
    a64 = a.astype(np.float64)
    with np.errstate(over="ignore"):
        overflow = np.isinf(a64.astype(np.float32)) & np.isfinite(a64)
    bad = ~np.isfinite(a64) | overflow | (a64 < 0) | ((a64 > 1) & unit_range)
    if bad.any():
        i = int(np.argmax(bad))
        v = a64[i]
        if not np.isfinite(v):
            what = "is not finite"
        elif overflow[i]:
            what = "overflows float32"
        else:
            what = "is outside [0, 1]" if unit_range else "is negative"
        raise MemoryInputError(f"{name}[{i}]: {_fmt(v)} {what}")
    return a.astype(np.float32) + np.float32(0)


def validate_upsert(
    ids: object, strengths: object, payloads: Sequence[bytes | None] | None, max_payload_bytes: int
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32], list[bytes | None] | None]:
    """Check an upsert batch whole; return ``(ids [K] uint64, strengths [K] float32, payloads)``.

    Args:
        ids: [K] non-negative integers.
        strengths: [K] numbers in [0, 1].
        payloads: None (leave payloads alone), or K items of bytes or None.
        max_payload_bytes: the cluster's largest payload, bytes.

    Raises:
        MemoryInputError: names the field and the first offending index (INVALID_ARGUMENT).
    """
    ids = as_ids(ids)
    values = validate_values(strengths, "strengths", ids, unit_range=True)
    if payloads is None:
        return ids, values, None
    payloads = list(payloads)
    if len(payloads) != len(ids):
        raise MemoryInputError(f"ids and payloads differ in length ({len(ids)} != {len(payloads)})")
    for i, p in enumerate(payloads):
        if p is not None and not isinstance(p, bytes | bytearray | memoryview):
            raise MemoryInputError(f"payloads[{i}]: expected bytes, got {type(p).__name__}")
        if p is not None and len(p) > max_payload_bytes:
            raise MemoryInputError(
                f"payloads[{i}]: {len(p)} bytes exceeds max_payload_bytes {max_payload_bytes}"
            )
    return ids, values, payloads


def validate_reinforce(
    ids: object, boosts: object
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.float32]]:
    """Check a reinforce batch whole; return ``(ids [K] uint64, boosts [K] float32)``.

    Boosts must be finite and >= 0 (they may exceed 1: strengths are clipped after adding).

    Raises:
        MemoryInputError: names the field and the first offending index (INVALID_ARGUMENT).
    """
    ids = as_ids(ids)
    return ids, validate_values(boosts, "boosts", ids)


def validate_rate(rate: object) -> np.float32:
    """Check a decay rate (finite, in [0, 1]) and return it as float32.

    Raises:
        MemoryInputError: not a real number (bools are refused), not finite, or outside
            [0, 1] (INVALID_ARGUMENT).
    """
    if isinstance(rate, bool) or not isinstance(rate, int | float | np.integer | np.floating):
        raise MemoryInputError(f"rate: {rate!r} is not a number")
    if not np.isfinite(rate):
        raise MemoryInputError(f"rate: {_fmt(rate)} is not finite")
    if not 0 <= rate <= 1:
        raise MemoryInputError(f"rate: {_fmt(rate)} is outside [0, 1]")
    return np.float32(rate)


MAX_OP_ID_BYTES = 64  # a UUID is 16; the journal's snapshot stores the length in 16 bits


def validate_op_id(op_id: bytes) -> bytes:
    """Check a bulk operation's id (at most ``MAX_OP_ID_BYTES``; empty means none).

    Raises:
        MemoryInputError: longer than ``MAX_OP_ID_BYTES`` (INVALID_ARGUMENT).
    """
    if len(op_id) > MAX_OP_ID_BYTES:
        raise MemoryInputError(f"op_id: {len(op_id)} bytes, at most {MAX_OP_ID_BYTES}")
    return bytes(op_id)


# Client request ids are kept per slot (up to the dedup table's 8192 ids) and ride in every
# copy and dump of the slot: 64 bytes bounds a slot's ids to 512 KiB (a UUID is 16).
MAX_REQUEST_ID_BYTES = 64


def validate_request_id(request_id: bytes, field: str = "request_id") -> bytes:
    """Check a keyed write's request id (at most ``MAX_REQUEST_ID_BYTES``; empty means none).

    Args:
        request_id: the id, as sent.
        field: the field, named in the error.

    Raises:
        MemoryInputError: longer than ``MAX_REQUEST_ID_BYTES`` (INVALID_ARGUMENT).
    """
    if len(request_id) > MAX_REQUEST_ID_BYTES:
        raise MemoryInputError(
            f"{field}: {len(request_id)} bytes exceeds the limit of {MAX_REQUEST_ID_BYTES} bytes"
        )
    return bytes(request_id)


def validate_k(k: object, k_max: int) -> int:
    """Check a top-k size: an integer in [1, k_max].

    Args:
        k: the requested size.
        k_max: the coordinator's ``topk_max``.

    Raises:
        MemoryInputError: not an integer (bools are refused), below 1 or above ``k_max``
            (INVALID_ARGUMENT).
    """
    if isinstance(k, bool) or not isinstance(k, int | np.integer):
        raise MemoryInputError(f"k: {k!r} is not an integer")
    if k < 1:
        raise MemoryInputError(f"k: {k} must be >= 1")
    if k > k_max:
        raise MemoryInputError(f"k: {k} exceeds the limit {k_max}")
    return int(k)
