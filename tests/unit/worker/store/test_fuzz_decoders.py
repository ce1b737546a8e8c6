"""Fuzz of the worker's decoders: memory-store request validation (``worker/store/store.py``) and
the journal's on-disk records and snapshots (``worker/store/journal_format.py``, ``recover``).

A store request is refused whole with ``MemoryInputError`` and leaves the store unchanged;
a journal record or snapshot that does not decode is a ``JournalError`` (the worker refuses
the data dir, naming it) — never another exception, and never a giant allocation from a
count read off the disk.
"""

from __future__ import annotations

import shutil
import struct
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from shared.memory.slots import slot_of
from shared.memory.validation import MemoryInputError, as_ids, as_slots, validate_k, validate_rate
from shared.proto import worker_pb2
from shared.rpc.codec import CodecError, f32_from_bytes, ids_from_bytes
from tests.fuzz_strategies import fuzz, message_bytes, mutated_bytes
from worker.store import journal_format as fmt
from worker.store.journal import JournalError, recover, segment_path
from worker.store.store import SlotSnapshot, SlotStore

S = 16
IDS = np.array([3, 17, 2**40 + 5, 2**63 + 9, 99], np.uint64)


def make_store(slots: int = S) -> SlotStore:
    return SlotStore(slots, device="cpu", max_payload_bytes=64, k_max=1000)


def loaded_store() -> SlotStore:
    store = make_store()
    store.upsert(IDS, np.linspace(0.1, 0.9, len(IDS), dtype=np.float32), [b"p"] * len(IDS))
    store.bump_seq(np.arange(S))
    return store


def contents(store: SlotStore) -> tuple[list[int], list[float], dict[int, bytes], list[int]]:
    ids, strengths = store.items()
    return ids.tolist(), strengths.tolist(), dict(store.payloads), store.seq.tolist()


# --- store request validation -------------------------------------------------------------

_DTYPES = st.sampled_from(
    [np.uint64, np.int64, np.int32, np.uint8, np.float32, np.float64, np.float16, bool]
) | st.sampled_from([np.complex64, np.dtype("U3"), np.dtype("S2"), np.dtype("m8[s]")])
_ARRAYS = hnp.arrays(_DTYPES, hnp.array_shapes(min_dims=0, max_dims=2, min_side=0, max_side=6))
_FLOAT_ARRAYS = hnp.arrays(
    np.float32,
    st.integers(0, 6),
    elements=st.sampled_from([0.0, -0.0, 0.5, 1.0, 1.5, -1.0, np.nan, np.inf, -np.inf, 3e38]),
)
_VALUES = _ARRAYS | _FLOAT_ARRAYS | st.lists(st.integers(-(2**65), 2**65) | st.floats())


@pytest.mark.filterwarnings("ignore::numpy.exceptions.ComplexWarning")  # empty complex arrays
@fuzz(250)
@given(
    op=st.sampled_from(["upsert", "reinforce", "delete", "get", "decay", "topk", "import"]),
    a=_VALUES,
    b=_VALUES,
    extra=st.one_of(st.none(), st.lists(st.binary(max_size=80) | st.none(), max_size=6)),
    number=st.one_of(st.integers(0, 2**32 - 1), st.floats()),  # what a proto field can carry
)
def test_store_refuses_bad_requests_whole_with_memory_input_error(
    op: str, a: Any, b: Any, extra: Any, number: Any
) -> None:
    store = loaded_store()
    before = contents(store)
    slot = number % (2 * S) if isinstance(number, int) else S  # in range or just past it
    calls = {
        "upsert": lambda: store.upsert(a, b, extra),
        "reinforce": lambda: store.reinforce(a, b),
        "delete": lambda: store.delete(a),
        "get": lambda: store.get(a),
        "decay": lambda: store.decay(number, a if extra is None else None),
        "topk": lambda: store.topk(number, a if extra is None else None),
        "import": lambda: store.import_slots([SlotSnapshot(slot, 1, a, b, {})]),
    }
    try:
        calls[op]()
    except MemoryInputError:
        assert contents(store) == before, "a refused request changed the store"
        return
    ids, strengths = store.items()
    assert ids.dtype == np.uint64 and strengths.dtype == np.float32
    assert ((strengths >= 0) & (strengths <= 1)).all()


@fuzz(200)
@given(a=_VALUES, k=st.integers(0, 2**32 - 1) | st.floats() | st.booleans())
def test_validators_return_clean_values_or_memory_input_error(a: Any, k: Any) -> None:
    for check in (
        lambda: as_ids(a),
        lambda: as_slots(a, S),
        lambda: validate_k(k, 1000),
        lambda: validate_rate(k),
    ):
        try:
            check()
        except MemoryInputError:
            pass


def _slot_data(slot: int) -> worker_pb2.SlotData:
    ids = IDS[slot_of(IDS, S) == slot]
    return worker_pb2.SlotData(
        slot=slot,
        seq=4,
        ids=ids.astype("<u8").tobytes(),
        strengths=np.full(len(ids), 0.5, "<f4").tobytes(),
        payload_ids=ids.tolist()[:1],
        payloads=[b"x"][: len(ids)],
        first=True,
    )


SLOT_SEEDS = [_slot_data(int(s)) for s in np.unique(slot_of(IDS, S))]


@fuzz(200)
@given(raws=st.lists(message_bytes(*SLOT_SEEDS), min_size=1, max_size=3))
def test_slot_copies_install_or_are_refused_whole(raws: list[bytes]) -> None:
    """Messages as ReceiveSlots decodes them: a refused copy changes nothing."""
    store = loaded_store()
    before = contents(store)
    snaps = []
    try:
        for raw in raws:
            msg = worker_pb2.SlotData.FromString(raw)
            if len(msg.payload_ids) != len(msg.payloads):
                raise MemoryInputError("payload_ids and payloads differ in length")
            ids, strengths = ids_from_bytes(msg.ids), f32_from_bytes(msg.strengths)
            payloads = dict(zip(msg.payload_ids, msg.payloads, strict=True))
            snaps.append(SlotSnapshot(msg.slot, msg.seq, ids, strengths, payloads))
        store.import_slots(snaps)
    except (MemoryInputError, CodecError, DecodeError):
        assert contents(store) == before, "a refused copy changed the store"


# --- journal ------------------------------------------------------------------------------


def _op_records() -> list[tuple[bytes, bytes]]:
    up = worker_pb2.UpsertRequest(
        ids=IDS.astype("<u8").tobytes(),
        strengths=np.full(len(IDS), 0.25, "<f4").tobytes(),
        payloads=[b"a", b"", b"b", b"", b"c"],
        request_id=b"rid",
    )
    slots = np.unique(slot_of(IDS, S)).tolist()
    ops = [
        worker_pb2.ReplicateRequest(
            primary="w", epoch=2, slots=slots, seqs=[2] * len(slots), upsert=up
        ),
        worker_pb2.ReplicateRequest(
            primary="w",
            epoch=2,
            slots=slots,
            seqs=[3] * len(slots),
            reinforce=worker_pb2.ReinforceRequest(
                ids=up.ids, boosts=np.full(len(IDS), 0.1, "<f4").tobytes(), request_id=b"r"
            ),
        ),
        worker_pb2.ReplicateRequest(
            primary="w",
            epoch=2,
            slots=[0, 5],
            seqs=[4, 4],
            decay=worker_pb2.WorkerDecayRequest(rate=0.5),
        ),
        worker_pb2.ReplicateRequest(
            primary="w",
            epoch=2,
            slots=slots[:1],
            seqs=[5],
            delete=worker_pb2.DeleteRequest(ids=up.ids[:8]),
        ),
    ]
    records = [(fmt.KIND_OP, op.SerializeToString()) for op in ops]
    records += [(fmt.KIND_IMPORT, s.SerializeToString()) for s in SLOT_SEEDS[:2]]
    records.append((fmt.KIND_DROP, np.array([1, 2], "<u4").tobytes()))
    return records


RECORDS = _op_records()


@st.composite
def records(draw: st.DrawFn) -> tuple[bytes, bytes]:
    kind, body = draw(st.sampled_from(RECORDS))
    if kind == fmt.KIND_DROP:
        body = draw(mutated_bytes(body) | st.binary(max_size=12))
    elif kind == fmt.KIND_OP:
        body = draw(message_bytes(worker_pb2.ReplicateRequest.FromString(body)))
    else:
        body = draw(message_bytes(worker_pb2.SlotData.FromString(body)))
    return draw(st.sampled_from([kind, kind, b"Z"])), body


@fuzz(300)
@given(record=records())
def test_replayed_log_records_apply_or_raise_journal_error(record: tuple[bytes, bytes]) -> None:
    """A record whose CRC matches (written by a buggy or hostile writer) but whose content
    does not decode must be a JournalError, not an exception from deep in the store."""
    store = loaded_store()
    kind, body = record
    try:
        fmt.replay(store, kind, body, lambda rid, slots: None)
    except JournalError:
        return
    ids, strengths = store.items()
    assert ((strengths >= 0) & (strengths <= 1)).all() and len(store.seq) == S


@fuzz(200)
@given(buf=st.sampled_from(RECORDS).flatmap(lambda r: mutated_bytes(fmt.frame(*r) * 2)))
def test_read_frames_yields_only_intact_records(buf: bytes) -> None:
    end = 0
    for end, kind, body in fmt.read_frames(buf, 0):
        length, crc = struct.unpack_from("<II", buf, end - len(kind + body) - 8)
        assert zlib.crc32(kind + body) == crc and length == len(kind + body)
    assert end <= len(buf)


def _snapshot_bytes() -> bytes:
    store = loaded_store()
    ids, strengths = store.rows()
    state = fmt.SnapshotState(
        S,
        3,
        store.seq.copy(),
        ids,
        strengths,
        dict(store.payloads),
        [(b"rid", [1, 2]), (b"", [])],
    )
    return b"".join(fmt.encode_snapshot(state))


SNAPSHOT = _snapshot_bytes()


def _with_crc(buf: bytes) -> bytes:
    """Recompute the trailing CRC so a mutated body reaches the parser."""
    if len(buf) < 4:
        return buf
    return buf[:-4] + struct.pack("<I", zlib.crc32(buf[:-4]))


@fuzz(300)
@given(buf=mutated_bytes(SNAPSHOT), fix_crc=st.booleans())
def test_snapshots_decode_or_raise_journal_error(buf: bytes, fix_crc: bool) -> None:
    if fix_crc:
        buf = _with_crc(buf)
    try:
        state = fmt.decode_snapshot(buf, "snapshot.bin")
    except JournalError:
        return
    assert len(state.seq) == state.slots and len(state.ids) == len(state.strengths)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-journal")


def _segment(records_: list[tuple[bytes, bytes]], slots: int = S) -> bytes:
    head = fmt.LOG_HEADER.pack(fmt.LOG_MAGIC, slots, 3)
    return head + b"".join(fmt.frame(k, b) for k, b in records_)


SEGMENT = _segment(RECORDS)


@fuzz(200)
@given(
    snapshot=st.none() | mutated_bytes(SNAPSHOT).map(_with_crc) | st.just(SNAPSHOT),
    segment=mutated_bytes(SEGMENT) | st.just(SEGMENT),
    fix_crcs=st.booleans(),
)
def test_recover_from_a_corrupt_data_dir_is_a_journal_error_or_a_store(
    scratch: Path, snapshot: bytes | None, segment: bytes, fix_crcs: bool
) -> None:
    d = scratch / "data"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    if snapshot is not None:
        (d / "snapshot.bin").write_bytes(snapshot)
    if fix_crcs:
        segment = _refresh_frame_crcs(segment)
    segment_path(d, 3).write_bytes(segment)
    try:
        got = recover(d, lambda slots: make_store(slots))
    except JournalError:
        return
    if got is not None:
        ids, strengths = got.store.items()
        assert len(ids) == len(strengths) and len(got.store.seq) == got.store.slots


def _refresh_frame_crcs(buf: bytes) -> bytes:
    """Rewrite every frame's CRC (length fields as they are) so mutated bodies get replayed."""
    out, pos = bytearray(buf), fmt.LOG_HEADER.size
    while pos + 8 <= len(out):
        length = struct.unpack_from("<I", out, pos)[0]
        end = pos + 8 + length
        if length < 1 or end > len(out):
            break
        struct.pack_into("<I", out, pos + 4, zlib.crc32(bytes(out[pos + 8 : end])))
        pos = end
    return bytes(out)


@pytest.mark.parametrize("slots", [0, 3, 1 << 31, 2**32 - 1])
def test_log_header_with_an_impossible_slot_count_is_a_journal_error(
    scratch: Path, slots: int
) -> None:
    d = scratch / f"slots-{slots}"
    d.mkdir()
    segment_path(d, 0).write_bytes(_segment([], slots))
    with pytest.raises(JournalError, match="slots"):
        recover(d, lambda s: make_store(s))


def test_snapshot_claiming_more_memories_than_it_holds_is_a_journal_error() -> None:
    head = fmt.SNAP_HEADER.unpack_from(SNAPSHOT)
    forged = fmt.SNAP_HEADER.pack(head[0], head[1], head[2], 1 << 40, *head[4:])
    buf = _with_crc(forged + SNAPSHOT[fmt.SNAP_HEADER.size :])
    with pytest.raises(JournalError, match="snapshot.bin"):
        fmt.decode_snapshot(buf, "snapshot.bin")


@pytest.mark.parametrize("count", [2**63 - 1, 2**64 - 1])
def test_snapshot_with_a_count_beyond_intp_is_a_journal_error(count: int) -> None:
    head = fmt.SNAP_HEADER.unpack_from(SNAPSHOT)
    forged = fmt.SNAP_HEADER.pack(head[0], head[1], head[2], count, *head[4:])
    buf = _with_crc(forged + SNAPSHOT[fmt.SNAP_HEADER.size :])
    with pytest.raises(JournalError, match="inconsistent snapshot"):
        fmt.decode_snapshot(buf, "snapshot.bin")


@pytest.mark.parametrize(
    "record",
    [
        (fmt.KIND_OP, worker_pb2.ReplicateRequest(slots=[S], seqs=[1]).SerializeToString()),
        (fmt.KIND_OP, worker_pb2.ReplicateRequest(slots=[1], seqs=[1]).SerializeToString()),
        (fmt.KIND_OP, b"\xff\xff\xff"),
        (fmt.KIND_DROP, b"\x01\x00\x00"),
        (fmt.KIND_IMPORT, worker_pb2.SlotData(slot=1, payload_ids=[5]).SerializeToString()),
    ],
    ids=["slot-out-of-range", "no-op", "not-protobuf", "drop-3-bytes", "payload-without-id"],
)
def test_log_record_regressions_are_journal_errors(record: tuple[bytes, bytes]) -> None:
    store = loaded_store()
    with pytest.raises(JournalError, match="log record"):
        fmt.replay(store, *record, lambda rid, slots: None)


def test_forwarded_op_with_partial_ids_is_a_codec_error() -> None:
    """The replica path (MemoryNode._apply_op) answers it INVALID_ARGUMENT."""
    store = loaded_store()
    before = contents(store)
    with pytest.raises(CodecError, match="ids: 1 bytes"):
        fmt.apply_op(store, "delete", worker_pb2.DeleteRequest(ids=b"\1"), np.array([1]))
    assert contents(store) == before
