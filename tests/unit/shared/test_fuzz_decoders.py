"""Fuzz of the decoders in ``shared`` that turn a peer's bytes into values: the tensor codec
(chunk streams, header-then-chunks streams, id/value arrays), the job-spec parser,
the slot-map check, and the memory input files (.npz/.npy a client may upload).

Each decoder must either return a valid value or raise its documented clean error
(``CodecError``, ``ConfigError``, ``SlotMapError``, ``MemoryFileError``); any other exception
(IndexError, struct.error, RecursionError, MemoryError from a giant allocation, ...) fails.
Inputs are mutated valid encodings and hostile field values (``tests/fuzz_strategies.py``).
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from google.protobuf.message import DecodeError
from hypothesis import given
from hypothesis import strategies as st

from shared.client.memory import MemoryRouter, RoutingError
from shared.config import ConfigError, JobSpec, job_spec_from_json, parse_job_spec
from shared.memory.files import MemoryFileError, load_memories, load_reinforcements, load_trace
from shared.memory.slots import SlotMapError, validate_slot_map
from shared.proto import common_pb2, worker_pb2
from shared.rpc.codec import (
    ChunkAssembler,
    CodecError,
    f32_from_bytes,
    ids_from_bytes,
    read_header_and_tensors,
    tensors_to_chunks,
)
from tests.fuzz_strategies import (
    fuzz,
    hostile_message,
    json_values,
    message_bytes,
    mutated_bytes,
    mutated_json_doc,
)

REPO = Path(__file__).resolve().parents[3]
JOB_SPECS = [yaml.safe_load(p.read_text()) for p in sorted((REPO / "configs/jobs").glob("*.yaml"))]


def parse_or_none(cls: Any, raw: bytes) -> Any:
    """The message ``raw`` parses to, or None (a DecodeError is the protobuf layer's clean
    refusal, answered INVALID_ARGUMENT by ``shared.rpc.interceptors``)."""
    try:
        return cls.FromString(raw)
    except DecodeError:
        return None


# --- tensor chunk streams -----------------------------------------------------------------


def _params() -> list[tuple[str, np.ndarray]]:
    return [
        ("w", np.arange(40, dtype=np.float32).reshape(5, 8)),
        ("b", np.ones(3, np.float64)),
        ("steps", np.array([7], np.int64)),
    ]


def _gradient_stream() -> list[worker_pb2.GradientRequest]:
    header = worker_pb2.GradientRequest(
        header=worker_pb2.StepHeader(job_id="j", step=3, params_included=True)
    )
    chunks = [worker_pb2.GradientRequest(param=c) for c in tensors_to_chunks(_params(), 64)]
    return [header, *chunks]


@st.composite
def mutated_streams(draw: st.DrawFn) -> list[Any]:
    """The valid header-then-chunks stream with messages mutated, dropped, repeated,
    swapped or added (each message parsed back from its possibly mutated bytes)."""
    msgs: list[Any] = list(_gradient_stream())
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(msgs) - 1))
        op = draw(st.sampled_from(["mutate", "drop", "repeat", "swap", "add"]))
        if op == "mutate":
            raw = draw(message_bytes(msgs[i]))
            msgs[i] = parse_or_none(worker_pb2.GradientRequest, raw) or msgs[i]
        elif op == "drop" and len(msgs) > 1:
            del msgs[i]
        elif op == "repeat":
            msgs.insert(i, msgs[i])
        elif op == "swap":
            j = draw(st.integers(0, len(msgs) - 1))
            msgs[i], msgs[j] = msgs[j], msgs[i]
        else:
            msgs.insert(i, draw(hostile_message(worker_pb2.GradientRequest())))
    return msgs


async def _aiter(items: Iterable[Any]) -> AsyncIterator[Any]:
    for item in items:
        yield item


@fuzz(100)
@given(stream=mutated_streams())
def test_header_and_chunk_streams_reassemble_or_raise_codec_error(stream: list[Any]) -> None:
    try:
        header, arrays = asyncio.run(read_header_and_tensors(_aiter(stream), "header", "param"))
    except CodecError:
        return
    assert header is None or header.job_id is not None
    chunks = [m.param for m in stream if m.WhichOneof("part") != "header"]
    for name, array in arrays.items():
        declared = next(c for c in chunks if c.name == name)
        assert array.shape == tuple(declared.shape) and array.dtype.name == declared.dtype


def test_valid_stream_round_trips() -> None:
    header, arrays = asyncio.run(
        read_header_and_tensors(_aiter(_gradient_stream()), "header", "param")
    )
    assert header.step == 3
    for name, expected in _params():
        np.testing.assert_array_equal(arrays[name], expected)


@fuzz(300)
@given(data=st.binary(max_size=80))
def test_id_and_value_bytes_decode_whole_values_or_raise_codec_error(data: bytes) -> None:
    for decode, size in ((ids_from_bytes, 8), (f32_from_bytes, 4)):
        try:
            values = decode(data)
        except CodecError as exc:
            assert len(data) % size and "bytes is not a whole number" in str(exc)
            continue
        assert len(values) * size == len(data)


@pytest.mark.parametrize(
    ("dtype", "shape", "data"),
    [
        ("float32", [-1, -2], b"\0" * 8),  # negative dims whose product matches the bytes
        ("float32", [2**32, 2**32], b""),  # a product that wraps to 0 in int64
        ("uint8", [2**62, 4], b""),
        ("float64", [-1], b""),
    ],
)
def test_tensor_shape_that_cannot_hold_the_bytes_is_a_codec_error(
    dtype: str, shape: list[int], data: bytes
) -> None:
    # Refused when the chunk arrives (its shape is checked before its bytes are kept), or at
    # the latest when the tensor is assembled.
    assembler = ChunkAssembler()
    with pytest.raises(CodecError, match="shape"):
        assembler.add(
            common_pb2.TensorChunk(
                name="t", dtype=dtype, shape=shape, data=data, total_bytes=len(data)
            )
        )
        assembler.result()


# --- job specs ----------------------------------------------------------------------------


def _check_spec(spec: JobSpec) -> None:
    assert spec.kind in ("train", "memory")
    json.dumps(spec.model_dump(mode="json"))  # a valid spec is plain data again


@fuzz(100)
@given(text=st.one_of(*(mutated_json_doc(s) for s in JOB_SPECS)))
def test_job_spec_from_json_accepts_or_raises_config_error(text: str) -> None:
    try:
        spec = job_spec_from_json(text)
    except ConfigError:
        return
    _check_spec(spec)


@fuzz(100)
@given(data=json_values(max_leaves=12) | st.sampled_from(JOB_SPECS))
def test_parse_job_spec_of_any_json_value_accepts_or_raises_config_error(data: Any) -> None:
    try:
        spec = parse_job_spec(data)
    except ConfigError:
        return
    _check_spec(spec)


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"kind": "train", "model": ' + "[" * 5000 + "]" * 5000 + "}",
        '{"kind": "memory", "memories": ' + "9" * 5000 + "}",
        '{"kind": "memory", "seed": 1e999}',
    ],
    ids=["deep-array", "deep-value", "5000-digit-int", "float-overflow"],
)
def test_spec_json_regressions_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError, match="spec_json|seed|memories"):
        job_spec_from_json(text)


# --- slot maps ----------------------------------------------------------------------------


def _valid_map() -> common_pb2.SlotMap:
    return common_pb2.SlotMap(
        epoch=5,
        slots=8,
        workers=["w0", "w1"],
        addresses=["127.0.0.1:1", "127.0.0.1:2"],
        primary=[0, 1, 0, 1, 0, 1, 0, -1],
        replica=[1, 0, 1, 0, 1, 0, -1, -1],
        max_payload_bytes=4096,
        max_batch_items=1 << 20,
    )


@fuzz(300)
@given(raw=message_bytes(_valid_map(), common_pb2.SlotMap(slots=1024)))
def test_slot_map_is_usable_or_a_slot_map_error(raw: bytes) -> None:
    m = parse_or_none(common_pb2.SlotMap, raw)
    if m is None:
        return
    try:
        validate_slot_map(m)
    except SlotMapError:
        return
    if m.epoch == 0:
        return  # no assignment yet: only the slot count is used
    # What the worker and the client do with an accepted map must not raise.
    n = len(m.workers)
    assert len(m.primary) == len(m.replica) == m.slots and len(m.addresses) == n
    owners = np.asarray(m.primary, np.int64)[np.arange(m.slots)]
    assert all(-1 <= o < n for o in owners.tolist() + list(m.replica))


# --- memory input files -------------------------------------------------------------------


def _npz_bytes(compressed: bool, **arrays: Any) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.getvalue()


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


MEMORIES = dict(ids=np.arange(5, dtype=np.uint64), strengths=np.linspace(0, 1, 5, dtype=np.float32))
BOOSTS = dict(ids=np.arange(4, dtype=np.int64), boosts=np.full(4, 0.25, np.float32))
FILE_SEEDS = [
    ("m.npz", _npz_bytes(False, **MEMORIES)),
    ("m.npz", _npz_bytes(True, **MEMORIES)),
    ("r.npz", _npz_bytes(False, **BOOSTS)),
    ("t.npy", _npy_bytes(np.arange(12, dtype=np.uint64).reshape(3, 4))),
]


@pytest.fixture(scope="module")
def file_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-files")


@fuzz(100)
@given(
    case=st.sampled_from(FILE_SEEDS).flatmap(
        lambda seed: st.tuples(st.just(seed[0]), mutated_bytes(seed[1], max_ops=3))
    )
)
def test_memory_files_load_or_raise_memory_file_error(case: tuple[str, bytes], file_dir) -> None:
    name, data = case
    path = file_dir / name
    path.write_bytes(data)
    loaders = {
        "m.npz": lambda: load_memories(path),
        "r.npz": lambda: load_reinforcements(path),
        "t.npy": lambda: load_trace(path, iterations=2),
    }
    try:
        result = loaders[name]()
    except MemoryFileError:
        return
    arrays = result if isinstance(result, tuple) else (result,)
    assert arrays[0].dtype == np.uint64


def _npy_header_claiming(shape: tuple[int, ...], dtype: str = "<u8") -> bytes:
    """A version 1.0 .npy header for ``shape`` with no data after it."""
    header = repr({"descr": dtype, "fortran_order": False, "shape": shape}).encode()
    header += b" " * (63 - (10 + len(header)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header


def test_npz_member_claiming_a_huge_array_is_refused_without_allocating(file_dir) -> None:
    import zipfile

    path = file_dir / "huge.npz"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("ids.npy", _npy_header_claiming((1 << 40,)))
        zf.writestr("strengths.npy", _npy_header_claiming((1 << 40,), "<f4"))
    with pytest.raises(MemoryFileError, match="ids"):
        load_memories(path)


def test_npy_trace_claiming_a_huge_array_is_refused_without_allocating(file_dir) -> None:
    path = file_dir / "huge.npy"
    path.write_bytes(_npy_header_claiming((1 << 20, 1 << 20)))
    with pytest.raises(MemoryFileError, match="huge.npy"):
        load_trace(path, iterations=1)


# --- the client's routing: slot maps and Get replies from peers -----------------------------


class _FakeWorker:
    """Answers Get with a fuzzed reply (as a hostile or buggy worker might)."""

    def __init__(self, reply: worker_pb2.GetResponse) -> None:
        self.reply = reply

    async def Get(self, request: worker_pb2.GetRequest, **options: Any) -> Any:  # noqa: N802
        return self.reply


def _get_reply_for(ids: np.ndarray) -> worker_pb2.GetResponse:
    return worker_pb2.GetResponse(
        found=np.ones(len(ids), np.uint8).tobytes(),
        strengths=np.full(len(ids), 0.5, "<f4").tobytes(),
        payloads=[b"p"] * len(ids),
    )


ROUTED_IDS = np.array([1, 2, 3, 2**40, 2**63 + 1], np.uint64)


@fuzz(200)
@given(
    map_raw=message_bytes(_valid_map()),
    reply_raw=message_bytes(_get_reply_for(ROUTED_IDS), _get_reply_for(ROUTED_IDS[:2])),
    with_payloads=st.booleans(),
)
def test_router_reads_peer_maps_and_replies_or_raises_routing_error(
    map_raw: bytes, reply_raw: bytes, with_payloads: bool
) -> None:
    m = parse_or_none(common_pb2.SlotMap, map_raw)
    reply = parse_or_none(worker_pb2.GetResponse, reply_raw)
    if m is None or reply is None:
        return

    async def fetch() -> common_pb2.SlotMap:
        return m

    async def get() -> Any:
        router = MemoryRouter(fetch, timeout_s=1.0, max_message_bytes=1 << 20, retry_budget_s=0)
        router._workers.stub = lambda name, address: _FakeWorker(reply)  # type: ignore[method-assign]
        try:
            return await router.get(ROUTED_IDS, with_payloads)
        finally:
            await router.close()

    try:
        found, strengths, payloads = asyncio.run(get())
    except RoutingError:
        return
    assert len(found) == len(strengths) == len(payloads) == len(ROUTED_IDS)
