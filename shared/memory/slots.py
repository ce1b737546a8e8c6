"""Slot hashing and placement for the sharded memory store.

A memory id maps to one of S hash slots (S a power of two) through a fixed 64-bit mixer,
never Python's ``hash()``, so every process and every run agrees on the slot of an id.
Slots are placed on workers by rendezvous (highest-random-weight) hashing.

Shape letters: N memories or batch items, S slots, W workers, G groups (slots present).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from shared.proto import common_pb2

_U64 = np.uint64
_C1 = _U64(0xBF58476D1CE4E5B9)
_C2 = _U64(0x94D049BB133111EB)


def mix64(x: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    """Mix 64-bit integers with the splitmix64 finalizer (a bijection on uint64).

    ``z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9; z = (z ^ (z >> 27)) * 0x94d049bb133111eb;
    z ^ (z >> 31)``, multiplications modulo 2**64. Source: Steele, Lea and Flood,
    "Fast splittable pseudorandom number generators", OOPSLA 2014.

    Args:
        x: [N] integers (cast to uint64; negative int64 values wrap modulo 2**64).

    Returns:
        [N] uint64, a new array.
    """
    z = np.asarray(x).astype(_U64, copy=True)
    if z.ndim:  # array ufuncs wrap silently; np.errstate costs more than a one-id mix
        return _mix(z)
    # Wraparound is the point of the multiplications; numpy only warns on scalar overflow.
    with np.errstate(over="ignore"):
        return _mix(z)


def _mix(z: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """The splitmix64 finalizer on ``z`` in place (``mix64``); returns ``z``."""
    z ^= z >> _U64(30)
    z *= _C1
    z ^= z >> _U64(27)
    z *= _C2
    z ^= z >> _U64(31)
    return z


def slot_bits(slots: int) -> int:
    """Return log2(slots), the number of low bits of mix64 that select a slot.

    Raises:
        ValueError: ``slots`` is not a power of two >= 1.
    """
    if not isinstance(slots, int | np.integer) or slots < 1 or slots & (slots - 1):
        raise ValueError(f"slots: {slots} is not a power of two >= 1")
    return int(slots).bit_length() - 1


def slot_of(ids: npt.ArrayLike, slots: int) -> npt.NDArray[np.int64]:
    """Return the slot of each id: ``mix64(id) & (slots - 1)``.

    Args:
        ids: [N] uint64 memory ids.
        slots: number of slots S, a power of two.

    Returns:
        [N] int64 slot numbers in [0, S).

    Raises:
        ValueError: ``slots`` is not a power of two.
    """
    slot_bits(slots)
    if isinstance(ids, np.ndarray) and ids.shape == (1,) and ids.dtype == _U64:
        # One id (the single-key path): Python integers cost a tenth of five ufunc calls.
        return np.array([_mix_int(int(ids[0])) & (slots - 1)], np.int64)
    return (mix64(ids) & _U64(slots - 1)).astype(np.int64)


_MASK64 = (1 << 64) - 1


def _mix_int(z: int) -> int:
    """``mix64`` of one integer in [0, 2**64), with Python integers."""
    z = ((z ^ (z >> 30)) * int(_C1)) & _MASK64
    z = ((z ^ (z >> 27)) * int(_C2)) & _MASK64
    return z ^ (z >> 31)


def sort_key(ids: npt.ArrayLike, slots: int) -> npt.NDArray[np.uint64]:
    """Return the storage key of each id: mix64(id) rotated right by log2(slots) bits.

    The slot (the low bits of mix64) lands in the top bits of the key, so sorting keys sorts
    by slot first and every slot is one contiguous segment. Rotation and mix64 are both
    bijections, so distinct ids have distinct keys.

    Args:
        ids: [N] uint64 memory ids.
        slots: number of slots S, a power of two.

    Returns:
        [N] uint64 keys.

    Raises:
        ValueError: ``slots`` is not a power of two.
    """
    b = slot_bits(slots)
    h = mix64(ids)
    if b == 0:
        return h
    return (h >> _U64(b)) | (h << _U64(64 - b))


def slot_key_range(slot: int, slots: int) -> tuple[int, int]:
    """Return the inclusive range ``(lo, hi)`` of the ``sort_key`` values of one slot.

    Args:
        slot: the slot, in [0, S).
        slots: number of slots S, a power of two.

    Returns:
        Python ints in [0, 2**64); a store finds the slot's rows between them.

    Raises:
        ValueError: ``slots`` is not a power of two, or ``slot`` is outside [0, S).
    """
    b = slot_bits(slots)
    if not 0 <= slot < slots:
        raise ValueError(f"slot: {slot} is outside [0, {slots})")
    width = 1 << (64 - b)
    return slot * width, (slot + 1) * width - 1


def slot_bounds(sorted_keys: npt.NDArray[np.uint64], slots: int) -> npt.NDArray[np.int64]:
    """Return the row offsets of every slot's segment in a sorted key array.

    Args:
        sorted_keys: [N] uint64 keys from :func:`sort_key`, ascending.
        slots: number of slots S, a power of two.

    Returns:
        [S + 1] int64; slot s occupies rows ``bounds[s]:bounds[s + 1]``.

    Raises:
        ValueError: ``slots`` is not a power of two.
    """
    b = slot_bits(slots)
    starts = np.arange(slots, dtype=_U64)
    if b:
        starts <<= _U64(64 - b)
    bounds = np.empty(slots + 1, dtype=np.int64)
    bounds[:slots] = np.searchsorted(sorted_keys, starts, side="left")
    bounds[slots] = len(sorted_keys)
    return bounds


def hash64(name: str) -> int:
    """Hash a worker name to 64 bits: blake2b (8-byte digest) read as little-endian uint64.

    Stable across processes and Python versions, unlike ``hash()``, so every process
    computes the same placement.
    """
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def rendezvous_weights(workers: Sequence[str], slots: int) -> npt.NDArray[np.uint64]:
    """Return the rendezvous weight of every (worker, slot): mix64(hash64(w) ^ mix64(s)).

    Args:
        workers: W worker names.
        slots: number of slots S.

    Returns:
        [W, S] uint64; the highest weight of a column owns that slot.
    """
    names = np.array([hash64(w) for w in workers], dtype=_U64).reshape(-1, 1)
    slot_mix = mix64(np.arange(slots, dtype=_U64)).reshape(1, -1)
    return mix64((names ^ slot_mix).ravel()).reshape(len(workers), slots)


def assign_slots(
    workers: Sequence[str], slots: int
) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """Place every slot on a primary and a replica worker by rendezvous hashing.

    The primary of a slot is the worker of highest weight, the replica the second highest
    (Thaler and Ravishankar, "Using name-based mappings to increase hit rates", IEEE/ACM
    ToN 1998). A slot only moves when a joining worker outranks its holders or a holder
    leaves, so membership changes move about S/W slots. Weights of distinct names collide
    with probability ~2**-64; ties then go to the later index in ``workers``.

    Args:
        workers: W distinct worker names, in any order.
        slots: number of slots S, a power of two.

    Returns:
        ``(primary, replica)``, each [S] int32 indexes into ``workers``; replica is -1 with
        one worker, both are -1 with none.

    Raises:
        ValueError: slots is not a power of two, or a worker name repeats.
    """
    slot_bits(slots)
    if len(set(workers)) != len(workers):
        raise ValueError("workers: names must be distinct")
    primary = np.full(slots, -1, dtype=np.int32)
    replica = np.full(slots, -1, dtype=np.int32)
    if not workers:
        return primary, replica
    weights_WS = rendezvous_weights(workers, slots)
    order_WS = np.argsort(weights_WS, axis=0, kind="stable")
    primary[:] = order_WS[-1]
    if len(workers) > 1:
        replica[:] = order_WS[-2]
    return primary, replica


def group_by_slot(
    slot_ids: npt.ArrayLike,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Group a batch by slot, stably: items of one slot keep their relative order.

    Args:
        slot_ids: [N] integer slot (or worker) number of every batch item.

    Returns:
        ``(order, present, bounds)``: order [N] int64 permutation of the batch, present [G]
        int64 distinct slots ascending, bounds [G + 1] int64; the items of ``present[g]``
        are ``order[bounds[g]:bounds[g + 1]]``, in batch order.
    """
    slots_N = np.asarray(slot_ids).astype(np.int64, copy=False)
    order = np.argsort(slots_N, kind="stable")
    present, starts = np.unique(slots_N[order], return_index=True)
    bounds = np.append(starts, len(slots_N)).astype(np.int64)
    return order.astype(np.int64), present.astype(np.int64), bounds


MAX_SLOTS = 1 << 16  # the largest slot count a coordinator may be configured with


class SlotMapError(ValueError):
    """A slot map received from a peer is inconsistent (INVALID_ARGUMENT).

    Nothing was adopted or routed with it; a client treats it as UNAVAILABLE and asks again.
    """


def validate_slot_map(m: common_pb2.SlotMap) -> None:
    """Check a ``SlotMap`` message before a worker adopts it or a client routes with it.

    A map of epoch 0 only carries the slot count (the registration reply); a later one
    assigns every slot: ``primary`` and ``replica`` [S] index into ``workers`` (-1: none),
    worker names are distinct and each has an address.

    Raises:
        SlotMapError: names the field and the first bad entry (INVALID_ARGUMENT).
    """
    if m.slots and (m.slots > MAX_SLOTS or m.slots & (m.slots - 1)):
        raise SlotMapError(f"slots: {m.slots} is not a power of two <= {MAX_SLOTS}")
    if m.epoch == 0:
        return
    if not m.slots:
        raise SlotMapError(f"slots: 0 in a map of epoch {m.epoch}")
    n = len(m.workers)
    if len(m.addresses) != n:
        raise SlotMapError(f"addresses: {len(m.addresses)} for {n} workers")
    if len(set(m.workers)) != n:
        raise SlotMapError("workers: a name repeats")
    for name in ("primary", "replica"):
        owners = np.asarray(getattr(m, name), np.int64)
        if len(owners) != m.slots:
            raise SlotMapError(f"{name}: {len(owners)} entries for {m.slots} slots")
        bad = np.flatnonzero((owners < -1) | (owners >= n))
        if len(bad):
            i = int(bad[0])
            raise SlotMapError(f"{name}[{i}]: {owners[i]} is not -1 or a worker index < {n}")
