"""Lossy wire forms of named float tensors (gradients, parameter deltas) for the sync strategy.

Pure NumPy, no gRPC: a :class:`Compressor` turns ``name -> array`` into ``name -> array`` of
plain wire dtypes that ``shared.rpc.codec.tensors_to_chunks`` sends as they are, and back.
The parts of a tensor are named ``name`` and ``name#part``; model parameter names
(``named_parameters()``) never contain ``#``, so a name with one is refused on both sides.

Schemes (N = a tensor's element count, k = :meth:`Compressor.k`):

- ``none``: ``name`` float32, the values as they are (4N bytes).
- ``fp16``: ``name`` float16 (2N bytes). Values are clipped to fp16's finite range
  (+-65504) first, so a large value is sent as the largest one rather than as inf; with
  error feedback the excess stays in the residual. Magnitudes under 2**-24 round to 0.
- ``int8``: per-tensor symmetric quantisation (N + 4 bytes): ``name`` int8 ``q =
  rint(x / s)`` and ``name#scale`` float32 0-d ``s = max|x| / 127``; decoded as ``q * s``,
  so each element is off by at most s/2 (Alistarh et al. 2017, "QSGD", with one level per
  integer and deterministic round-to-nearest rather than QSGD's stochastic rounding: the
  rounding error is not unbiased, and error feedback, not the expectation, is what corrects
  it).
- ``topk``: the k elements of largest magnitude, ``k = min(N, max(1, ceil(ratio * N)))``
  (8k bytes): ``name#idx`` flat C-order indices, strictly increasing, int32 when N < 2**31
  else int64, and ``name#val`` float32 values; every other element decodes as 0 (Aji &
  Heafield 2017, "Sparse Communication for Distributed Gradient Descent"; Stich et al. 2018,
  "Sparsified SGD with Memory"). Selected with ``np.argpartition``, O(N).

Lossy schemes are meant to be used with error feedback (``shared.training.error_feedback``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast, get_args

import numpy as np
import numpy.typing as npt

Scheme = Literal["none", "fp16", "int8", "topk"]
SCHEMES: tuple[str, ...] = get_args(Scheme)
SEP = "#"
_PARTS: dict[str, tuple[str, ...]] = {  # the wire parts of one tensor, "" = the bare name
    "none": ("",),
    "fp16": ("",),
    "int8": ("", "scale"),
    "topk": ("idx", "val"),
}
_FP16_MAX = float(np.finfo(np.float16).max)

Arrays = dict[str, npt.NDArray[np.generic]]


class CompressionError(ValueError):
    """Tensors that cannot be encoded, or a wire form that does not decode (INVALID_ARGUMENT).

    The message names the tensor at fault.
    """


def wire_bytes(wire: Mapping[str, np.ndarray]) -> int:
    """The data bytes of a wire form: the sum of its arrays' ``nbytes`` (no message framing)."""
    return sum(int(np.asarray(a).nbytes) for a in wire.values())


def check_name(name: str) -> None:
    """Refuse a tensor name containing ``#``, the separator of wire parts.

    Raises:
        CompressionError: naming the tensor (INVALID_ARGUMENT).
    """
    if SEP in name:
        raise CompressionError(f"tensor name {name!r} contains {SEP!r}")


def index_dtype(numel: int) -> np.dtype[np.signedinteger]:
    """The dtype of a top-k tensor's ``#idx``: int32 when ``numel < 2**31``, else int64."""
    return np.dtype(np.int32) if numel < 2**31 else np.dtype(np.int64)


@dataclass(frozen=True)
class Compressor:
    """One scheme of lossy encoding of named float32 tensors, the same on both ends of a link.

    Attributes:
        name: the scheme, one of ``none | fp16 | int8 | topk``.
        ratio: fraction of elements ``topk`` keeps, in (0, 1]; ignored by other schemes.

    Raises:
        CompressionError: an unknown scheme or a ratio outside (0, 1] (INVALID_ARGUMENT).
    """

    name: Scheme = "none"
    ratio: float = 0.01

    def __post_init__(self) -> None:
        """Check the scheme and the ratio."""
        if self.name not in SCHEMES:
            raise CompressionError(f"unknown compression {self.name!r}, expected one of {SCHEMES}")
        if not (0.0 < self.ratio <= 1.0) or not math.isfinite(self.ratio):
            raise CompressionError(f"compression ratio must be in (0, 1], got {self.ratio}")

    @property
    def lossless(self) -> bool:
        """True for ``none``: nothing is lost, so error feedback keeps no residual."""
        return self.name == "none"

    def k(self, numel: int) -> int:
        """Elements top-k keeps of a tensor of ``numel`` elements: min(N, max(1, ceil(r N)))."""
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def encode(self, tensors: Mapping[str, npt.ArrayLike]) -> Arrays:
        """Encode named tensors into their wire form.

        Args:
            tensors: name -> array of any shape (0-d and empty too), real values cast to
                float32; names free of ``#``.

        Returns:
            name or ``name#part`` -> array of a codec wire dtype (see the module docstring),
            in the order of ``tensors``.

        Raises:
            CompressionError: a name contains ``#``, or a value is not finite (inf and NaN
                have no faithful compressed form and would stay in an error-feedback residual
                forever; a sender that wants the receiver's non-finite check to see them sends
                them with ``none``). The message names the tensor (INVALID_ARGUMENT).
        """
        wire: Arrays = {}
        for name, value in tensors.items():
            check_name(name)
            try:
                x = np.asarray(value, dtype=np.float32)
            except (TypeError, ValueError) as exc:
                raise CompressionError(f"tensor {name!r}: not real numbers ({exc})") from None
            if self.name != "none" and not np.isfinite(x).all():
                raise CompressionError(f"tensor {name!r} has non-finite values")
            for part, array in self._encode_one(x).items():
                wire[name + (SEP + part if part else "")] = array
        return wire

    def _encode_one(self, x: npt.NDArray[np.float32]) -> Arrays:
        """The parts of one finite float32 tensor, keyed by part name ("" = the bare name)."""
        if self.name == "none":
            return {"": x}
        if self.name == "fp16":
            return {"": np.clip(x, -_FP16_MAX, _FP16_MAX).astype(np.float16)}
        if self.name == "int8":
            peak = float(np.abs(x).max()) if x.size else 0.0
            scale = np.float32(peak / 127.0)
            q = np.rint(x / scale) if scale > 0 else np.zeros_like(x)
            return {"": np.clip(q, -127, 127).astype(np.int8), "scale": np.asarray(scale)}
        flat = x.reshape(-1)
        k = self.k(flat.size)
        top = np.argpartition(np.abs(flat), flat.size - k)[flat.size - k :] if k else flat[:0]
        idx = np.sort(top).astype(index_dtype(flat.size))
        return {"idx": idx, "val": flat[idx].astype(np.float32)}

    def decode(
        self, wire: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]
    ) -> dict[str, npt.NDArray[np.float32]]:
        """Decode a wire form back into dense float32 tensors.

        Checks structure, not values: a NaN in a ``none``/``fp16`` tensor or a top-k value
        is returned as it is, for the receiver's own non-finite check.

        Args:
            wire: what :meth:`encode` made (after the codec), name or ``name#part`` -> array.
            shapes: name -> shape of every tensor the wire must carry (both ends know the
                model); the wire carries exactly these tensors.

        Returns:
            name -> float32 array of ``shapes[name]``, in the order of ``shapes``.

        Raises:
            CompressionError: a key of an unknown tensor or part, a tensor missing or missing
                a part, a wrong dtype or shape, a scale that is not finite and >= 0, a top-k
                index out of range or not strictly increasing, or a top-k count other than k.
                The message names the tensor (INVALID_ARGUMENT).
        """
        parts: dict[str, dict[str, np.ndarray]] = {}
        for key, array in wire.items():
            name, _, part = key.partition(SEP)
            if name not in shapes:
                raise CompressionError(f"tensor {name!r} is not one of the model's tensors")
            if part not in _PARTS[self.name]:
                raise CompressionError(f"tensor {name!r}: unexpected part {key!r} for {self.name}")
            parts.setdefault(name, {})[part] = np.asarray(array)
        out: dict[str, npt.NDArray[np.float32]] = {}
        for name, shape in shapes.items():
            got = parts.get(name, {})
            missing = [p for p in _PARTS[self.name] if p not in got]
            if missing:
                keys = [name + (SEP + p if p else "") for p in missing]
                raise CompressionError(f"tensor {name!r}: missing {keys} in the {self.name} wire")
            out[name] = self._decode_one(name, got, tuple(shape))
        return out

    def _decode_one(
        self, name: str, got: dict[str, np.ndarray], shape: tuple[int, ...]
    ) -> npt.NDArray[np.float32]:
        """Decode the parts of one tensor (all present) into a float32 array of ``shape``."""
        if self.name in ("none", "fp16", "int8"):
            want = {"none": np.float32, "fp16": np.float16, "int8": np.int8}[self.name]
            x = _checked(name, "", got[""], want, shape)
            if self.name != "int8":
                return x.astype(np.float32)
            scale = got["scale"]
            if scale.dtype != np.float32 or scale.size != 1 or scale.ndim > 1:
                raise CompressionError(
                    f"tensor {name!r}: scale must be float32 of shape () or (1,), "
                    f"got {scale.dtype} {list(scale.shape)}"
                )
            s = float(scale.reshape(()))
            if not (math.isfinite(s) and s >= 0):
                raise CompressionError(f"tensor {name!r}: scale {s} is not finite and >= 0")
            return x.astype(np.float32) * np.float32(s)
        numel = math.prod(shape)
        k = self.k(numel)
        idx = _checked(name, "idx", got["idx"], index_dtype(numel), (k,))
        val = _checked(name, "val", got["val"], np.float32, (k,))
        if k and (idx[0] < 0 or idx[-1] >= numel or (k > 1 and not (np.diff(idx) > 0).all())):
            raise CompressionError(
                f"tensor {name!r}: top-k indices must be strictly increasing in [0, {numel})"
            )
        dense = np.zeros(numel, np.float32)
        dense[idx] = val
        return dense.reshape(shape)


def _checked(
    name: str, part: str, a: np.ndarray, dtype: npt.DTypeLike, shape: tuple[int, ...]
) -> np.ndarray:
    """``a`` when it has ``dtype`` and ``shape``, else a CompressionError naming the tensor."""
    if a.dtype != np.dtype(dtype) or tuple(a.shape) != shape:
        key = name + (SEP + part if part else "")
        raise CompressionError(
            f"tensor {name!r}: {key!r} must be {np.dtype(dtype).name} {list(shape)}, "
            f"got {a.dtype} {list(a.shape)}"
        )
    return a


def sync_compressor(name: str, ratio: float) -> Compressor | None:
    """The ``Compressor`` of a sync or diloco job's ``compression``; None for ``none``.

    Args:
        name: ``compression.name`` of the spec.
        ratio: ``compression.ratio`` (top-k's kept fraction).

    Raises:
        CompressionError: a name that is not a scheme of the gRPC path (``bf16`` and
            ``powersgd`` are allreduce's DDP hooks) (INVALID_ARGUMENT).
    """
    if name == "none":
        return None
    if name in SCHEMES:
        return Compressor(cast(Scheme, name), ratio)
    raise CompressionError(f"compression.name: {name!r} is not a scheme of the gRPC path")


def downlink_compressor(uplink: Compressor) -> Compressor:
    """The scheme of the parameter deltas sent to workers, given the gradients' scheme.

    ``fp16`` and ``int8`` deltas use the gradients' scheme. With ``topk`` the deltas go as
    ``int8`` instead: an optimizer step (Adam's above all) moves every parameter a little, so
    a top-k of the delta leaves most of a worker's copy behind for many steps and its
    gradients are computed at stale parameters (measured on the digits MLP, 3 workers, 15
    epochs, top-k 1%: test accuracy 0.64 with top-k deltas, 0.90 with float32 ones), while
    int8 with error feedback keeps every coordinate within one quantisation step of the
    coordinator's at 1/4 of float32's bytes.
    """
    return Compressor("int8") if uplink.name == "topk" else uplink
