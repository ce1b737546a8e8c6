"""Error feedback for compressed sends: what a send lost is added to the next one.

Uplink (worker -> coordinator, gradients): :class:`ErrorFeedback`, one per sender, keeps the
residual ``e``; each step sends ``C(x + e)`` and keeps ``e <- (x + e) - D(C(x + e))``, so the
sum of everything decoded plus the final residual equals the sum of everything given, and a
compressor that drops 99% of a step's coordinates (top-k at 1%) still delivers them all, late
(Seide et al. 2014, "1-Bit Stochastic Gradient Descent and its Application to Data-Parallel
Distributed Training of Speech DNNs"; Stich et al. 2018, "Sparsified SGD with Memory";
Karimireddy et al. 2019, "Error Feedback Fixes SignSGD and other Gradient Compression
Schemes", algorithm 2).

Downlink (coordinator -> worker, parameters): :class:`DeltaSender` sends the difference
between the parameters and the receiver's copy ``held``; the receiver adds it with
:func:`apply_delta`. ``params - held`` is itself the residual: what a send did not carry is
still in the next difference. The first send, and every send after :meth:`DeltaSender.reset`
or with ``none``, carries the full float32 values with the marker ``#full``.

Residuals and held copies are float32, as the values they track; the identities above hold
to float32 rounding of the additions.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from shared.training.compression import Arrays, CompressionError, Compressor, check_name

F32 = dict[str, npt.NDArray[np.float32]]
FULL = "#full"  # marker tensor of a full (not delta) parameter send: 0-d bool True


class NoHeldCopy(CompressionError):
    """A parameter delta for a receiver that holds no copy to add it to (FAILED_PRECONDITION).

    The sender answers by calling :meth:`DeltaSender.reset` and sending again in full.
    """


class ErrorFeedback:
    """One sender's compression with error feedback (see the module docstring)."""

    def __init__(self, compressor: Compressor) -> None:
        """Start with a zero residual.

        Args:
            compressor: the link's scheme; with ``none`` no residual is kept.
        """
        self.compressor = compressor
        self._residual: F32 = {}

    @property
    def residual(self) -> F32:
        """The float32 residual e of each tensor sent so far, by name (a copy)."""
        return {n: e.copy() for n, e in self._residual.items()}

    def reset(self) -> None:
        """Forget the residual (a new job, or a receiver that lost the training state)."""
        self._residual = {}

    def compress(self, tensors: Mapping[str, npt.ArrayLike]) -> Arrays:
        """Encode ``x + e`` and keep what the encoding lost as the new ``e``.

        Args:
            tensors: name -> array (cast to float32), the same names and shapes every step.

        Returns:
            The wire form (``Compressor.encode``); decode it with the tensors' shapes.

        Raises:
            CompressionError: as ``Compressor.encode``, or a tensor whose shape differs from
                its residual's; the residual is then left as it was (INVALID_ARGUMENT).
        """
        if self.compressor.lossless:
            return self.compressor.encode(tensors)
        corrected: F32 = {}
        for name, value in tensors.items():
            x = np.asarray(value, dtype=np.float32)
            e = self._residual.get(name)
            if e is not None and e.shape != x.shape:
                raise CompressionError(
                    f"tensor {name!r}: shape {list(x.shape)} but its residual is {list(e.shape)}"
                )
            corrected[name] = x + e if e is not None else x.copy()
        wire = self.compressor.encode(corrected)
        sent = self.compressor.decode(wire, {n: c.shape for n, c in corrected.items()})
        for name, c in corrected.items():
            c -= sent[name]  # in place: corrected is ours
            self._residual[name] = c
        return wire


class DeltaSender:
    """The parameter downlink to one receiver: compressed deltas against its copy."""

    def __init__(self, compressor: Compressor) -> None:
        """Start with no held copy: the first send is full.

        Args:
            compressor: the link's scheme; with ``none`` every send is full.
        """
        self.compressor = compressor
        self._held: F32 | None = None

    @property
    def held(self) -> F32 | None:
        """The receiver's copy as this sender reconstructs it (None before the first send)."""
        return None if self._held is None else {n: h.copy() for n, h in self._held.items()}

    def reset(self) -> None:
        """Forget the receiver's copy: the next send is full.

        Call it whenever a send may not have been applied (an RPC failed or timed out, the
        receiver restarted or answered ``NoHeldCopy``), since the copies then differ.
        """
        self._held = None

    def send(self, params: Mapping[str, npt.ArrayLike]) -> Arrays:
        """The wire form that brings the receiver's copy to (close to) ``params``.

        Args:
            params: name -> array (cast to float32), the same names and shapes every send.

        Returns:
            Full: ``FULL`` -> 0-d bool True and name -> float32 copy of each parameter.
            Delta: ``Compressor.encode(params - held)``. Either way the held copy becomes
            what :func:`apply_delta` makes of it on the receiver, bit for bit.

        Raises:
            CompressionError: as ``Compressor.encode``, or names/shapes that differ from the
                held copy's; the held copy is then left as it was (INVALID_ARGUMENT).
        """
        x = {n: np.array(v, dtype=np.float32) for n, v in params.items()}  # copies
        if self._held is None or self.compressor.lossless:
            for name in x:
                check_name(name)
            self._held = x
            return {FULL: np.asarray(True), **{n: a.copy() for n, a in x.items()}}
        held = self._held
        if {n: a.shape for n, a in x.items()} != {n: h.shape for n, h in held.items()}:
            raise CompressionError(
                f"parameters {sorted(x)[:8]} differ in names or shapes from the held copy"
            )
        wire = self.compressor.encode({n: a - held[n] for n, a in x.items()})
        self._held = apply_delta(self.compressor, held, wire, {n: h.shape for n, h in held.items()})
        return wire


def apply_delta(
    compressor: Compressor,
    held: Mapping[str, np.ndarray] | None,
    wire: Mapping[str, np.ndarray],
    shapes: Mapping[str, tuple[int, ...]],
) -> F32:
    """The receiver's side of :meth:`DeltaSender.send`: its new copy of the parameters.

    Args:
        compressor: the link's scheme, as the sender's.
        held: name -> float32 array, the copy the last call returned (not modified since),
            or None when the receiver has none.
        wire: what ``DeltaSender.send`` returned (after the codec).
        shapes: name -> shape of every parameter.

    Returns:
        name -> float32 array of ``shapes[name]``, new arrays (``held`` is not modified).

    Raises:
        NoHeldCopy: a delta and ``held`` is None (FAILED_PRECONDITION).
        CompressionError: a malformed wire form (as ``Compressor.decode``; a full send is
            decoded as ``none``), a ``#full`` marker other than 0-d bool True, or ``held``
            of other names or shapes (INVALID_ARGUMENT).
    """
    if FULL in wire:
        marker = np.asarray(wire[FULL])
        if marker.dtype != np.bool_ or marker.shape != () or not bool(marker):
            raise CompressionError(f"{FULL!r} must be a 0-d bool True")
        rest = {n: a for n, a in wire.items() if n != FULL}
        return Compressor("none").decode(rest, shapes)
    if held is None:
        raise NoHeldCopy("a parameter delta arrived but no full copy is held")
    delta = compressor.decode(wire, shapes)
    out: F32 = {}
    for name, d in delta.items():
        h = held.get(name)
        if h is None or h.dtype != np.float32 or h.shape != d.shape:
            raise CompressionError(f"tensor {name!r}: the held copy is missing or of other shape")
        out[name] = h + d
    return out
