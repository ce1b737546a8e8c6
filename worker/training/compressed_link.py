"""A worker's side of a compressed ``sync`` training link (the spec's ``compression``).

Parameters arrive as deltas against the copy this worker holds (``apply_delta``; a full send
carries the ``#full`` marker), and gradients leave through ``ErrorFeedback``, whose residual
carries what one step did not send into the next (Seide et al. 2014; Stich et al. 2018;
Karimireddy et al. 2019; see ``shared.training.error_feedback``). Buffers (BatchNorm
statistics) travel uncompressed beside them. With ``compression: none`` nothing here is
used: parameters and gradients travel as float32.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from shared.config import TrainJobSpec
from shared.training.compression import Compressor, downlink_compressor, sync_compressor
from shared.training.error_feedback import ErrorFeedback, apply_delta


class StaleBase(RuntimeError):
    """A parameter delta against a version this worker does not hold.

    The worker answers ``need_params`` and the coordinator resends in full.
    """


class CompressedLink:
    """One job's compressed link on a worker: the held parameters and the gradient residual."""

    def __init__(self, spec: TrainJobSpec, param_shapes: Mapping[str, tuple[int, ...]]) -> None:
        """Hold nothing yet.

        Args:
            spec: the job; ``compression.name`` is fp16, int8 or topk (``ratio``).
            param_shapes: name -> shape of every parameter (``named_parameters()``).
        """
        compressor = sync_compressor(spec.compression.name, spec.compression.ratio)
        assert compressor is not None, "a compressed link needs a compression"
        self.compressor: Compressor = compressor
        self.downlink = downlink_compressor(compressor)
        self.feedback = ErrorFeedback(self.compressor)
        self.shapes = dict(param_shapes)
        self.held: dict[str, np.ndarray] | None = None
        self.held_version: int | None = None

    def receive(
        self,
        tensors: Mapping[str, np.ndarray],
        version: int,
        base_version: int,
    ) -> dict[str, np.ndarray]:
        """The parameters (and buffers) of ``version`` from a compressed send.

        Args:
            tensors: the wire form of the parameters (``DeltaSender.send``) and the buffers
                by name (any tensor whose name is not a wire part of a parameter).
            version: the coordinator's parameter version they make.
            base_version: the version a delta applies to.

        Returns:
            name -> array: float32 parameters and the buffers as sent, for ``set_params``.

        Raises:
            StaleBase: a delta whose base this worker does not hold (FAILED_PRECONDITION:
                answered with ``need_params``).
            CompressionError: a malformed wire form (INVALID_ARGUMENT).
        """
        wire = {n: a for n, a in tensors.items() if _param_part(n) in self.shapes or n == "#full"}
        buffers = {n: a for n, a in tensors.items() if n not in wire}
        if "#full" not in wire and (self.held is None or self.held_version != base_version):
            raise StaleBase(f"a delta on version {base_version}, held {self.held_version}")
        self.held = apply_delta(self.downlink, self.held, wire, self.shapes)
        self.held_version = version
        return {**self.held, **buffers}

    def forget(self) -> None:
        """Drop the held copy (a failed load): the next send must be full."""
        self.held = self.held_version = None

    def send(self, grads: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The wire form of finite gradients, with error feedback (the residual advances)."""
        return self.feedback.compress(grads)


def _param_part(name: str) -> str:
    """``fc.weight#idx`` -> ``fc.weight``: the parameter a wire part belongs to."""
    return name.split("#", 1)[0]
