"""On-disk formats of a worker's journal (``worker/store/journal.py``): log records and snapshots.

Log segment ``log-<gen>.wal``: a header (magic, slot count, generation), then records, each
framed as ``[u32 length][u32 crc32][kind][body]`` (length and CRC cover kind + body), so a
torn or corrupt tail is detected and replay stops before it. Kinds:

- ``R``: a mutation as forwarded to replicas, a serialized ``ReplicateRequest`` (slots, the
  seqs they reached, and the upsert/reinforce/delete/decay it applied);
- ``I``: a slot installed by a copy, a serialized whole-slot ``SlotData``;
- ``D``: slots dropped, ``[n] <u4``;
- ``T``: a table's incarnation id adopted from the slot map, a serialized ``TableSpec``
  (name and id; ``SlotStore.adopt_table``);
- ``X``: a table dropped, its name (UTF-8).

An ``I`` record is one table's part of a slot (``SlotData.table``): the default table's part
replaces the whole slot (every table), a later part of the same copy only its table's.

Snapshot ``snapshot.bin``: a header, then the seq of every slot, the ids and strengths of
every memory of the default table (grouped by slot; a reader takes any order), its payloads,
the recent client request ids; then (``NSSNAP02``) the other tables, each with its name,
incarnation id, ids, strengths, payloads and insert stamps; and a CRC32 of everything before it. A
``NSSNAP01`` file (written before tables) holds the default table only. Little-endian
throughout.

Shape letters: S slots, N memories, P memories with a payload.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from shared.memory.slots import MAX_SLOTS
from shared.memory.tables import DEFAULT_TABLE, table_name
from shared.memory.validation import as_slots
from shared.proto import common_pb2, worker_pb2
from shared.rpc.codec import f32_from_bytes, ids_from_bytes
from worker.store.store import SlotSnapshot, SlotStore

LOG_MAGIC, SNAP_MAGIC, SNAP_MAGIC_V1 = b"NSLOG001", b"NSSNAP02", b"NSSNAP01"
LOG_HEADER = struct.Struct("<8sIQ")  # magic, slots, generation
FRAME = struct.Struct("<II")  # length of kind + body, crc32 of kind + body
SNAP_HEADER = struct.Struct("<8sIQQQQI")  # magic, slots, generation, N, P, payload bytes, recent
KIND_OP, KIND_IMPORT, KIND_DROP = b"R", b"I", b"D"
KIND_TABLE, KIND_DROP_TABLE = b"T", b"X"
TABLE_HEADER = struct.Struct("<QQQQ")  # id, N, P, payload bytes (after the u16 name length)
MAX_RECORD_BYTES = 1 << 31

# A client request id and the slots that applied it (``dedup.RecentRequests``).
Request = tuple[bytes, list[int]]


class JournalError(Exception):
    """A data dir cannot be used: corrupt snapshot, other slot count, or in use."""


def frame(kind: bytes, body: bytes) -> bytes:
    """One framed log record."""
    data = kind + body
    return FRAME.pack(len(data), zlib.crc32(data)) + data


def read_frames(buf: bytes | memoryview, start: int) -> Iterator[tuple[int, bytes, bytes]]:
    """Yield ``(end offset, kind, body)`` of each intact record from ``start``.

    Stops at the end of ``buf`` or at the first torn or corrupt record (its offset is the
    last ``end``).
    """
    pos = start
    while pos + FRAME.size <= len(buf):
        length, crc = FRAME.unpack_from(buf, pos)
        end = pos + FRAME.size + length
        if length < 1 or end > len(buf):
            return
        data = bytes(buf[pos + FRAME.size : end])
        if zlib.crc32(data) != crc:
            return
        yield end, data[:1], data[1:]
        pos = end


# --- records ------------------------------------------------------------------------------


def apply_op(store: SlotStore, op: str, sub: Any, slots: np.ndarray) -> bytes:
    """Apply one forwarded mutation to a store (not its seqs); return its request/op id.

    The replica path (``MemoryNode._apply_op``) and log replay share it, so a replayed log
    changes the store exactly as the live operations did.
    """
    table = table_name(sub.table)
    if op == "upsert":
        payloads = list(sub.payloads) if len(sub.payloads) else None
        stamps = _ids(sub.stamps) if sub.stamps else None
        store.upsert(
            _ids(sub.ids), _f32(sub.strengths), payloads, sub.existing_only, table, None, stamps
        )
    elif op == "reinforce":
        store.reinforce(_ids(sub.ids), _f32(sub.boosts), table)
    elif op == "delete":
        store.delete(_ids(sub.ids), table)
    elif op == "decay":
        forget = sub.forget_below if sub.HasField("forget_below") else None
        store.decay(sub.rate, slots, table, forget)
        return bytes(sub.op_id)
    return bytes(sub.request_id)


def stamps_bytes(ids: np.ndarray, stamps: dict[int, int]) -> bytes:
    """Insert stamps as sent beside ids [n] uint64: [n] uint64 (0: none), or b"" for none."""
    if not stamps:
        return b""
    return np.fromiter((stamps.get(i, 0) for i in ids.tolist()), "<u8", len(ids)).tobytes()


def stamps_dict(ids: np.ndarray, data: bytes) -> dict[int, int]:
    """The stamps of ``stamps_bytes`` back as id -> stamp (0s left out).

    Raises:
        ValueError: not one uint64 per id.
    """
    if not data:
        return {}
    stamps = ids_from_bytes(data)
    if len(stamps) != len(ids):
        raise ValueError(f"{len(stamps)} stamps for {len(ids)} ids")
    held = stamps != 0
    return dict(zip(ids[held].tolist(), stamps[held].tolist(), strict=True))


def encode_import(snap: SlotSnapshot) -> bytes:
    """Return the body of an import record: the whole slot as one serialized ``SlotData``."""
    pids = [i for i in snap.ids.tolist() if i in snap.payloads] if snap.payloads else []
    body: bytes = worker_pb2.SlotData(
        slot=snap.slot,
        seq=snap.seq,
        first=True,
        ids=snap.ids.astype("<u8").tobytes(),
        strengths=snap.strengths.astype("<f4").tobytes(),
        payload_ids=pids,
        payloads=[snap.payloads[i] for i in pids],
        request_ids=snap.requests,
        table="" if snap.table == DEFAULT_TABLE else snap.table,
        stamps=stamps_bytes(snap.ids, snap.stamps),
    ).SerializeToString()
    return body


def replay(
    store: SlotStore,
    kind: bytes,
    body: bytes,
    on_request: Callable[[bytes, list[int]], None],
    on_import: Callable[[int, list[bytes]], None] | None = None,
) -> None:
    """Apply one log record to ``store``; report client request ids to ``on_request``.

    An imported slot's request ids go to ``on_import(slot, ids)`` instead: they replace the
    ids recorded for that slot before (``RecentRequests.replace_slot``).

    Raises:
        JournalError: an unknown record kind (a newer format), or a record whose content does
            not decode or does not apply (the CRC matched: written so, not torn).
    """
    try:
        _replay(store, kind, body, on_request, on_import)
    except (DecodeError, ValueError) as exc:  # MemoryInputError is a ValueError
        raise JournalError(f"log record of kind {kind!r} is invalid: {exc}") from None


def _replay(
    store: SlotStore,
    kind: bytes,
    body: bytes,
    on_request: Callable[[bytes, list[int]], None],
    on_import: Callable[[int, list[bytes]], None] | None,
) -> None:
    if kind == KIND_OP:
        req = worker_pb2.ReplicateRequest.FromString(body)
        slots = as_slots(list(req.slots), store.slots, "record.slots")
        op = req.WhichOneof("op")
        if op is None or len(req.seqs) != len(slots):
            raise ValueError(f"op {op}, {len(req.seqs)} seqs for {len(slots)} slots")
        rid = apply_op(store, op, getattr(req, op), slots)
        store.seq[slots] = np.fromiter(req.seqs, np.uint64, len(req.seqs))
        if rid:
            on_request(rid, slots.tolist())
    elif kind == KIND_IMPORT:
        msg = worker_pb2.SlotData.FromString(body)
        if len(msg.payload_ids) != len(msg.payloads):
            raise ValueError(f"{len(msg.payloads)} payloads for {len(msg.payload_ids)} ids")
        table = table_name(msg.table)
        snap = SlotSnapshot(
            msg.slot,
            msg.seq,
            _ids(msg.ids),
            _f32(msg.strengths),
            dict(zip(msg.payload_ids, msg.payloads, strict=True)),
            table=table,
            stamps=stamps_dict(_ids(msg.ids), msg.stamps),
        )
        store.import_slots([snap], whole_slots=table == DEFAULT_TABLE)
        if on_import is not None and table == DEFAULT_TABLE:
            on_import(msg.slot, list(msg.request_ids))
    elif kind == KIND_DROP:
        store.drop_slots(np.frombuffer(body, "<u4").astype(np.int64))
    elif kind == KIND_TABLE:
        spec = common_pb2.TableSpec.FromString(body)
        store.adopt_table(spec.name, spec.id)
    elif kind == KIND_DROP_TABLE:
        store.drop_table(body.decode())
    else:
        raise JournalError(f"log record kind {kind!r} is unknown (written by a newer version?)")


# --- snapshots ------------------------------------------------------------------------------


@dataclass
class SnapshotState:
    """A worker's whole store at one point of its log (host arrays, copied).

    Attributes:
        slots: S. gen: the log generation that continues from this state.
        seq: [S] uint64. ids: [N] uint64 in store (slot key) order. strengths: [N] float32.
        payloads: id -> payload. recent: client request ids applied, oldest first.
    """

    slots: int
    gen: int
    seq: np.ndarray
    ids: np.ndarray
    strengths: np.ndarray
    payloads: dict[int, bytes] = field(default_factory=dict)
    recent: list[Request] = field(default_factory=list)
    tables: list[TableState] = field(default_factory=list)


@dataclass
class TableState:
    """A table other than the default one in a snapshot: name, incarnation id, memories.

    Attributes:
        name: the table. id: its incarnation id (0: not known yet).
        ids: [N] uint64. strengths: [N] float32. payloads: id -> payload.
        stamps: id -> insert stamp (a capped table's).
    """

    name: str
    id: int
    ids: np.ndarray
    strengths: np.ndarray
    payloads: dict[int, bytes] = field(default_factory=dict)
    stamps: dict[int, int] = field(default_factory=dict)


def _memory_pieces(
    ids: np.ndarray, strengths: np.ndarray, payloads: dict[int, bytes]
) -> tuple[np.ndarray, np.ndarray, list[bytes]]:
    pids = np.fromiter(payloads.keys(), np.uint64, len(payloads))
    blobs = list(payloads.values())
    lens = np.fromiter((len(b) for b in blobs), np.uint32, len(blobs))
    return pids, lens, blobs


def _table_pieces(t: TableState) -> Iterator[bytes]:
    name = t.name.encode()
    pids, lens, blobs = _memory_pieces(t.ids, t.strengths, t.payloads)
    yield struct.pack("<H", len(name)) + name
    yield TABLE_HEADER.pack(t.id, len(t.ids), len(pids), int(lens.sum()))
    yield t.ids.astype("<u8").tobytes()
    yield t.strengths.astype("<f4").tobytes()
    yield pids.astype("<u8").tobytes()
    yield lens.astype("<u4").tobytes()
    yield from blobs
    stamp_ids = np.fromiter(t.stamps.keys(), np.uint64, len(t.stamps))
    stamp_values = np.fromiter(t.stamps.values(), np.uint64, len(t.stamps))
    yield struct.pack("<Q", len(stamp_ids))
    yield stamp_ids.astype("<u8").tobytes()
    yield stamp_values.astype("<u8").tobytes()


def encode_snapshot(st: SnapshotState) -> Iterator[bytes]:
    """Yield the snapshot file's bytes in pieces; the last piece is the CRC32 of the rest."""
    pids, lens, blobs = _memory_pieces(st.ids, st.strengths, st.payloads)
    recent = b"".join(
        struct.pack("<HI", len(rid), len(slots)) + rid + np.asarray(slots, "<u4").tobytes()
        for rid, slots in st.recent
    )
    crc = 0
    for piece in (
        SNAP_HEADER.pack(
            SNAP_MAGIC, st.slots, st.gen, len(st.ids), len(pids), int(lens.sum()), len(st.recent)
        ),
        st.seq.astype("<u8").tobytes(),
        st.ids.astype("<u8").tobytes(),
        st.strengths.astype("<f4").tobytes(),
        pids.astype("<u8").tobytes(),
        lens.astype("<u4").tobytes(),
        *blobs,
        recent,
        struct.pack("<I", len(st.tables)),
        *(piece for t in st.tables for piece in _table_pieces(t)),
    ):
        crc = zlib.crc32(piece, crc)
        yield piece
    yield struct.pack("<I", crc)


def decode_snapshot(buf: bytes, name: str) -> SnapshotState:
    """Parse a snapshot file's bytes.

    Raises:
        JournalError: bad magic or CRC, or truncated (``name`` is the file, for the message).
    """
    if len(buf) < SNAP_HEADER.size + 4 or buf[:8] not in (SNAP_MAGIC, SNAP_MAGIC_V1):
        raise JournalError(f"{name}: not a neuroshard snapshot (bad magic)")
    if zlib.crc32(memoryview(buf)[:-4]) != struct.unpack_from("<I", buf, len(buf) - 4)[0]:
        raise JournalError(f"{name}: CRC mismatch, the snapshot is corrupt")
    try:  # the CRC matched: counts that do not fit the file were written so
        return _decode_snapshot(buf, name)
    except (ValueError, OverflowError, struct.error) as exc:
        raise JournalError(f"{name}: inconsistent snapshot ({exc})") from None


def check_slot_count(slots: int, name: str) -> None:
    """Raises: JournalError unless ``slots`` is a power of two <= MAX_SLOTS (read off disk)."""
    if not 1 <= slots <= MAX_SLOTS or slots & (slots - 1):
        raise JournalError(f"{name}: {slots} slots is not a power of two <= {MAX_SLOTS}")


def _decode_snapshot(buf: bytes, name: str) -> SnapshotState:
    magic, slots, gen, n, p, blob_bytes, n_recent = SNAP_HEADER.unpack_from(buf)
    check_slot_count(slots, name)
    pos = SNAP_HEADER.size

    def take(count: int, dtype: str) -> np.ndarray:
        nonlocal pos
        a = np.frombuffer(buf, dtype, count, pos)
        pos += a.nbytes
        return a

    def memories(n: int, p: int, blob_bytes: int) -> TableState:
        nonlocal pos
        ids = take(n, "<u8").astype(np.uint64)
        strengths, pids = take(n, "<f4").astype(np.float32), take(p, "<u8").tolist()
        lens = take(p, "<u4").astype(np.int64)
        ends = np.cumsum(lens) + pos
        starts = ends - lens
        if int(lens.sum()) != blob_bytes or pos + blob_bytes > len(buf) - 4:
            raise ValueError(f"payload lengths sum to {int(lens.sum())}, header says {blob_bytes}")
        payloads = {
            i: buf[a:b] for i, a, b in zip(pids, starts.tolist(), ends.tolist(), strict=True)
        }
        pos += blob_bytes
        return TableState(DEFAULT_TABLE, 0, ids, strengths, payloads)

    seq = take(slots, "<u8").astype(np.uint64)
    default = memories(n, p, blob_bytes)
    recent: list[Request] = []
    for _ in range(n_recent):
        k, m = struct.unpack_from("<HI", buf, pos)
        rid = buf[pos + 6 : pos + 6 + k]
        pos += 6 + k
        recent.append((rid, take(m, "<u4").tolist()))
    tables: list[TableState] = []
    if magic == SNAP_MAGIC:
        (n_tables,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        for _ in range(n_tables):
            (k,) = struct.unpack_from("<H", buf, pos)
            name = buf[pos + 2 : pos + 2 + k].decode()
            pos += 2 + k
            table_id, tn, tp, tb = TABLE_HEADER.unpack_from(buf, pos)
            pos += TABLE_HEADER.size
            t = memories(tn, tp, tb)
            t.name, t.id = name, table_id
            (n_stamps,) = struct.unpack_from("<Q", buf, pos)
            pos += 8
            stamp_ids, stamp_values = take(n_stamps, "<u8"), take(n_stamps, "<u8")
            t.stamps = dict(zip(stamp_ids.tolist(), stamp_values.tolist(), strict=True))
            tables.append(t)
    if pos != len(buf) - 4:
        raise ValueError(f"{len(buf) - 4 - pos} bytes between the last section and the CRC")
    return SnapshotState(
        slots, gen, seq, default.ids, default.strengths, default.payloads, recent, tables
    )


def _ids(b: bytes) -> np.ndarray:
    return ids_from_bytes(b).copy()  # CodecError when not whole uint64 values


def _f32(b: bytes) -> np.ndarray:
    return f32_from_bytes(b).copy()
