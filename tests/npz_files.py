"""Hostile ``.npz`` files for upload tests, built byte by byte (no code under test involved)."""

from __future__ import annotations

import io
import zipfile
import zlib

import numpy as np


def npz_bytes(compressed: bool = False, **arrays: np.ndarray) -> bytes:
    """The bytes ``np.savez`` (or ``np.savez_compressed``) writes for ``arrays``."""
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.getvalue()


def npy_bytes(array: np.ndarray) -> bytes:
    """The bytes ``np.save`` writes for ``array``."""
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def corrupt_deflate_npz(intact_bytes: int = 32 * 1024) -> bytes:
    """A training set whose ``x`` member is a deflate stream that breaks after its header.

    The member's raw deflate data is the first ``intact_bytes`` of a valid ``x`` compressed
    and flushed to a byte boundary, then ``0xff`` bytes: a block of the reserved type 3, which
    zlib refuses ("invalid block type"). With the default its header reads fine and its data
    does not; with 4096 (zipfile inflates at least 4 KiB at a time) reading the header fails.
    """
    x = npy_bytes(np.random.default_rng(0).normal(size=(2000, 8)).astype(np.float32))
    y = npy_bytes(np.arange(2000, dtype=np.int64) % 3)
    deflate = zlib.compressobj(6, zlib.DEFLATED, -15)
    raw = deflate.compress(x[:intact_bytes]) + deflate.flush(zlib.Z_FULL_FLUSH) + b"\xff" * 64
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr("x.npy", raw)
        zf.writestr("y.npy", y)
    data = bytearray(buf.getvalue())
    # Declare the x member deflated, with the size and CRC of the real x (local header and
    # central directory entry alike).
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as zf:
        info = zf.getinfo("x.npy")
    local = info.header_offset
    central = data.index(b"PK\x01\x02")  # x.npy is the first central directory entry
    for at, method_at, crc_at in ((local, 8, 14), (central, 10, 16)):
        data[at + method_at : at + method_at + 2] = zipfile.ZIP_DEFLATED.to_bytes(2, "little")
        data[at + crc_at : at + crc_at + 4] = zlib.crc32(x).to_bytes(4, "little")
        data[at + crc_at + 8 : at + crc_at + 12] = len(x).to_bytes(4, "little")
    return bytes(data)
