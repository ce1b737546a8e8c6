"""The wire forms of shared.training.compression: round trips, sizes, golden vectors, refusals."""

from __future__ import annotations

import numpy as np
import pytest

from shared.rpc.codec import ChunkAssembler, tensors_to_chunks
from shared.training.compression import CompressionError, Compressor, wire_bytes

MILLION = 1_000_000


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "fc.weight": rng.standard_normal((64, 33)).astype(np.float32),
        "fc.bias": rng.standard_normal(33).astype(np.float32),
        "scalar": np.asarray(np.float32(-0.75)),
        "empty": np.zeros((0, 4), np.float32),
    }


def _shapes(t: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    return {n: a.shape for n, a in t.items()}


def _through_codec(wire: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What the receiver reassembles from the existing codec's chunks (small chunks)."""
    assembler = ChunkAssembler()
    for chunk in tensors_to_chunks(wire.items(), chunk_bytes=1000):
        assembler.add(chunk)
    return assembler.result()


@pytest.mark.parametrize("scheme", ["none", "fp16", "int8", "topk"])
def test_every_scheme_decodes_to_float32_of_the_model_shapes(scheme: str) -> None:
    t = _tensors()
    c = Compressor(scheme)  # type: ignore[arg-type]
    out = c.decode(_through_codec(c.encode(t)), _shapes(t))
    assert list(out) == list(t)
    assert all(out[n].dtype == np.float32 and out[n].shape == t[n].shape for n in t)
    if scheme == "none":
        assert all(np.array_equal(out[n], t[n]) for n in t)


def test_fp16_relative_error_is_under_a_thousandth() -> None:
    x = np.random.default_rng(1).uniform(1e-3, 1e3, 10_000).astype(np.float32)
    x *= np.where(np.arange(x.size) % 2, 1, -1).astype(np.float32)
    c = Compressor("fp16")
    wire = c.encode({"x": x})
    assert wire["x"].dtype == np.float16
    got = c.decode(wire, {"x": x.shape})["x"]
    assert np.max(np.abs(got - x) / np.abs(x)) < 1e-3  # fp16: 11 significant bits, 2**-11


def test_fp16_clips_to_its_finite_range_instead_of_overflowing() -> None:
    c = Compressor("fp16")
    got = c.decode(c.encode({"x": np.array([1e6, -1e6], np.float32)}), {"x": (2,)})["x"]
    assert got.tolist() == [65504.0, -65504.0]


def test_int8_error_is_at_most_half_a_step_and_the_peak_is_exact() -> None:
    x = np.random.default_rng(2).standard_normal((300, 70)).astype(np.float32)
    c = Compressor("int8")
    wire = c.encode({"w": x})
    scale = float(wire["w#scale"])
    assert wire["w"].dtype == np.int8 and wire["w#scale"].dtype == np.float32
    assert scale == pytest.approx(np.abs(x).max() / 127, rel=1e-6)
    got = c.decode(wire, {"w": x.shape})["w"]
    assert np.max(np.abs(got - x)) <= scale / 2 * (1 + 1e-5)
    assert np.abs(wire["w"]).max() == 127


def test_int8_golden_vector_and_an_all_zero_tensor() -> None:
    # Arrange: peak 2.54 -> scale 0.02; q = round(x / 0.02), worked out by hand.
    c = Compressor("int8")
    # Act
    wire = c.encode({"a": np.array([1.0, -2.54, 0.3], np.float32), "z": np.zeros(5, np.float32)})
    # Assert
    assert wire["a"].tolist() == [50, -127, 15]
    assert float(wire["a#scale"]) == pytest.approx(0.02)
    assert float(wire["z#scale"]) == 0.0 and wire["z"].tolist() == [0] * 5
    assert c.decode(wire, {"a": (3,), "z": (5,)})["z"].tolist() == [0.0] * 5


def test_topk_golden_vector_keeps_the_k_largest_magnitudes_and_zeros_the_rest() -> None:
    x = np.array([[0.1, -5.0, 2.0], [3.0, 0.0, -4.0]], np.float32)
    c = Compressor("topk", ratio=0.5)  # k = ceil(0.5 * 6) = 3
    wire = c.encode({"m": x})
    assert wire["m#idx"].dtype == np.int32 and wire["m#idx"].tolist() == [1, 3, 5]
    assert wire["m#val"].tolist() == [-5.0, 3.0, -4.0]
    got = c.decode(wire, {"m": (2, 3)})["m"]
    assert got.tolist() == [[0.0, -5.0, 0.0], [3.0, 0.0, -4.0]]


def test_topk_on_a_large_tensor_keeps_exactly_the_k_largest() -> None:
    x = np.random.default_rng(3).permutation(100_003).astype(np.float32) - 50_000
    c = Compressor("topk", ratio=0.01)
    k = c.k(x.size)
    got = c.decode(c.encode({"x": x}), {"x": x.shape})["x"]
    kept = np.flatnonzero(got)
    assert k == 1001 and kept.size == k
    assert np.array_equal(np.sort(np.abs(x[kept])), np.sort(np.abs(x))[-k:])
    assert np.array_equal(got[kept], x[kept])


def test_topk_keeps_at_least_one_element_and_nothing_of_an_empty_tensor() -> None:
    c = Compressor("topk", ratio=0.001)
    wire = c.encode({"b": np.array([0.5, -2.0], np.float32), "e": np.zeros(0, np.float32)})
    assert wire["b#idx"].tolist() == [1] and wire["b#val"].tolist() == [-2.0]
    assert wire["e#idx"].size == 0 and wire["e#val"].size == 0


@pytest.mark.parametrize(
    ("scheme", "ratio", "at_least"),
    [("fp16", 0.01, 2.0), ("int8", 0.01, 3.5), ("topk", 0.01, 40.0)],
)
def test_bytes_on_a_million_elements_against_float32(
    scheme: str, ratio: float, at_least: float
) -> None:
    x = np.random.default_rng(4).standard_normal(MILLION).astype(np.float32)
    wire = Compressor(scheme, ratio).encode({"x": x})  # type: ignore[arg-type]
    ratio_vs_f32 = (4 * MILLION) / wire_bytes(wire)
    assert ratio_vs_f32 >= at_least
    expected = {"fp16": 2 * MILLION, "int8": MILLION + 4, "topk": 8 * 10_000}[scheme]
    assert wire_bytes(wire) == expected  # topk: 10,000 int32 indices + 10,000 float32 values


def test_encode_refuses_a_name_with_the_separator_and_non_finite_values() -> None:
    for scheme in ("none", "fp16", "int8", "topk"):
        with pytest.raises(CompressionError, match="'a#b' contains"):
            Compressor(scheme).encode({"a#b": np.zeros(2, np.float32)})  # type: ignore[arg-type]
    for scheme in ("fp16", "int8", "topk"):
        with pytest.raises(CompressionError, match="'w' has non-finite"):
            Compressor(scheme).encode({"w": np.array([1.0, np.nan])})  # type: ignore[arg-type]


def test_a_bad_scheme_or_ratio_is_refused() -> None:
    with pytest.raises(CompressionError, match="unknown compression"):
        Compressor("zip")  # type: ignore[arg-type]
    for ratio in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(CompressionError, match="ratio"):
            Compressor("topk", ratio)


_INT8 = Compressor("int8")
_TOPK = Compressor("topk", 0.5)
_SHAPES = {"w": (2, 2)}


def _int8_wire(**change: np.ndarray | None) -> dict[str, np.ndarray]:
    wire = _INT8.encode({"w": np.array([[1, -2], [3, 4]], np.float32)})
    return _changed(wire, change)


def _topk_wire(**change: np.ndarray | None) -> dict[str, np.ndarray]:
    wire = _TOPK.encode({"w": np.array([[1, -2], [3, 4]], np.float32)})
    return _changed(wire, change)


def _changed(
    wire: dict[str, np.ndarray], change: dict[str, np.ndarray | None]
) -> dict[str, np.ndarray]:
    for part, value in change.items():
        key = "w" if part == "bare" else f"w#{part}"
        if value is None:
            del wire[key]
        else:
            wire[key] = value
    return wire


@pytest.mark.parametrize(
    ("compressor", "wire", "message"),
    [
        (_INT8, {**_int8_wire(), "v": np.zeros(1, np.int8)}, "'v' is not one of"),
        (_INT8, {**_int8_wire(), "w#idx": np.zeros(1, np.int32)}, "unexpected part 'w#idx'"),
        (_INT8, _int8_wire(scale=None), r"missing \['w#scale'\]"),
        (_INT8, _int8_wire(bare=None, scale=None), r"missing \['w', 'w#scale'\]"),
        (_INT8, _int8_wire(bare=np.zeros((2, 2), np.int16)), "must be int8"),
        (_INT8, _int8_wire(bare=np.zeros(4, np.int8)), r"must be int8 \[2, 2\]"),
        (_INT8, _int8_wire(scale=np.array(np.inf, np.float32)), "scale inf is not finite"),
        (_INT8, _int8_wire(scale=np.array(-1.0, np.float32)), "scale -1.0"),
        (_INT8, _int8_wire(scale=np.array(1.0)), "scale must be float32"),
        (_INT8, _int8_wire(scale=np.ones(2, np.float32)), "scale must be float32"),
        (_TOPK, _topk_wire(val=None), r"missing \['w#val'\]"),
        (_TOPK, _topk_wire(idx=np.array([1, 4], np.int32)), "strictly increasing in"),
        (_TOPK, _topk_wire(idx=np.array([-1, 2], np.int32)), "strictly increasing in"),
        (_TOPK, _topk_wire(idx=np.array([2, 2], np.int32)), "strictly increasing"),
        (_TOPK, _topk_wire(idx=np.array([3, 2], np.int32)), "strictly increasing"),
        (_TOPK, _topk_wire(idx=np.array([2, 3], np.int64)), "'w#idx' must be int32"),
        (_TOPK, _topk_wire(idx=np.arange(4, dtype=np.int32)), r"must be int32 \[2\]"),
        (_TOPK, _topk_wire(val=np.ones(2, np.float16)), "'w#val' must be float32"),
        (Compressor("fp16"), {"w": np.zeros((2, 2), np.float32)}, "'w' must be float16"),
        (Compressor("none"), {}, r"tensor 'w': missing \['w'\]"),
    ],
)
def test_malformed_wire_forms_raise_naming_the_tensor(
    compressor: Compressor, wire: dict[str, np.ndarray], message: str
) -> None:
    with pytest.raises(CompressionError, match=message):
        compressor.decode(wire, _SHAPES)


def test_wire_bytes_counts_every_part() -> None:
    wire = Compressor("int8").encode({"a": np.ones(10, np.float32)})
    assert wire_bytes(wire) == 10 + 4
