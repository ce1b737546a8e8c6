"""The vocabulary of one sync or diloco training step on the coordinator.

``StepOrder`` (what every piece is computed from), ``Piece`` (the rows one call computes),
``StepPlan`` (a step's pieces as its strategy plans them), ``StepPolicy`` (how late and bad
answers are treated), ``ShardResult`` (one answer), ``StepOutcome`` (what the step gathered)
and ``Member`` (one worker's seat in a job).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from grpc import aio

from shared.proto import worker_pb2, worker_pb2_grpc
from shared.training.error_feedback import DeltaSender

# ComputeGradients taking serialized requests and answering (reply, its size in bytes):
# ``coordinator.training.train_members.gradient_call``.
GradientCall = aio.StreamStreamMultiCallable[bytes, tuple[worker_pb2.GradientResponse, int]]


@dataclass
class Member:
    """One worker's seat in a job."""

    name: str
    stub: worker_pb2_grpc.WorkerStub
    gradients: GradientCall | None = None  # ComputeGradients on the stub's channel
    params_version: int = -1  # the parameter version this worker holds
    sender: DeltaSender | None = None  # compression: what this worker holds, as deltas
    samples: int = 0
    steps: int = 0
    compute_s: float = 0.0  # seconds of forward/backward it reported for this job


@dataclass(frozen=True)
class InnerSteps:
    """diloco: the local steps a step's calls run, as the workers' inner lr schedule needs.

    Sent in every call's header (``worker_pb2.InnerSteps``), so the workers need not work out
    the job's step layout themselves.

    Attributes:
        first: the job-wide index of the step's first inner step (from 0).
        total: inner steps per shard of the whole job (the schedule's span, >= 1).
    """

    first: int
    total: int


@dataclass(frozen=True)
class StepOrder:
    """What every shard of one step is computed from.

    Attributes:
        step: the global step, from 0.
        epoch: its epoch, from 0.
        step_in_epoch: its step within the epoch, from 0.
        version: the parameter server's version of ``tensors``.
        tensors: parameters and buffers by state_dict name (float32 parameters, buffers in
            their dtype), sent to a worker that does not hold ``version``.
        buffer_names: the names in ``tensors`` that are buffers (their answers too).
        loss_scale: the fp16 loss scale the workers multiply the loss by (1.0: none).
        inner_steps: diloco: the local steps every piece runs; None: gradients (sync).
    """

    step: int
    epoch: int
    step_in_epoch: int
    version: int
    tensors: dict[str, np.ndarray] = field(repr=False)
    buffer_names: frozenset[str] = frozenset()
    loss_scale: float = 1.0
    inner_steps: InnerSteps | None = None


@dataclass(frozen=True)
class Piece:
    """Rows of one step that one ComputeGradients call computes.

    With ``batch_policy: fixed`` a step has one piece per shard (its rows of the step); with
    ``proportional`` one piece per active member, slices of the step's global batch sized
    by the members' measured samples/s.

    Attributes:
        index: the piece's place in the step, from 0.
        rows: [R] int64 global training rows (R >= 0).
        shard: the shard all the rows belong to, or -1 when they span shards.
        member: the member the piece was sized for (proportional), None: round-robin.
        inner_rows: diloco: ``rows`` cut into the local steps' batches, these many rows
            each (summing to R); empty for sync.
        weights: prioritized sampling: [R] float32 importance weights aligned with
            ``rows`` (``coordinator.training.prioritized``); None: uniform (all 1).
    """

    index: int
    rows: np.ndarray = field(repr=False)
    shard: int = -1
    member: str | None = None
    inner_rows: tuple[int, ...] = ()
    weights: np.ndarray | None = field(default=None, repr=False)


@dataclass(frozen=True)
class StepPlan:
    """One step's pieces as the job's strategy plans them, and where the step is.

    Attributes:
        pieces: the step's pieces, together its global batch.
        step_in_epoch: what the workers' headers say: the step within its epoch (sync), or
            the first inner step it covers within the epoch (diloco).
        inner_steps: diloco: the local steps every piece runs; None: gradients (sync).
    """

    pieces: list[Piece]
    step_in_epoch: int
    inner_steps: InnerSteps | None = None


@dataclass(frozen=True)
class StepPolicy:
    """How one step treats late and bad answers (``spec.straggler`` and precision).

    Attributes:
        mode: ``wait``, ``backup`` or ``drop`` (``StragglerSpec.mode``).
        deadline_s: seconds after the step's start when ``backup`` launches copies of the
            missing pieces and ``drop`` goes on without them.
        min_fraction: ``drop``: the share of the step's samples that must have arrived.
        reject_nonfinite: a piece whose gradient is not finite is rejected (False with fp16,
            where it means a loss-scale overflow and the step is skipped instead).
    """

    mode: str = "wait"
    deadline_s: float = float("inf")
    min_fraction: float = 1.0
    reject_nonfinite: bool = True


@dataclass
class ShardResult:
    """One piece's answer to a step: what its rows contributed, and how the call went.

    Attributes:
        samples: rows of the step (0 when the shard ran out this epoch).
        loss_sum: the loss summed over those rows.
        correct: rows predicted right.
        grads: parameter name -> gradient of the mean loss, float32 of the parameter's shape,
            unscaled.
        buffers: buffer name -> the worker's buffer after the step (e.g. BatchNorm running
            statistics), in the buffer's dtype.
        finite: every gradient element is finite.
        worker: the member that computed it.
        wall_s: seconds of the call as the coordinator saw it (transfer, queueing, compute).
        compute_s: seconds of forward and backward on the worker.
        bytes_to_worker: bytes sent to the worker (header and parameters).
        bytes_from_worker: bytes received from it (result, gradients, buffers).
        losses: prioritized sampling: [R] float32 the rows' unweighted per-sample losses,
            aligned with the piece's rows; None: uniform.
    """

    samples: int
    loss_sum: float
    correct: int
    grads: dict[str, np.ndarray] = field(repr=False)
    buffers: dict[str, np.ndarray] = field(repr=False, default_factory=dict)
    finite: bool = True
    worker: str = ""
    wall_s: float = 0.0
    compute_s: float = 0.0
    bytes_to_worker: int = 0
    bytes_from_worker: int = 0
    losses: np.ndarray | None = field(default=None, repr=False)


@dataclass
class StepOutcome:
    """What one step gathered.

    Attributes:
        results: piece index -> its accepted answer.
        rejected: (worker, piece index, reason) of answers refused (non-finite gradients).
        dropped: piece indices left out at the deadline (``drop``), rejected ones aside.
        backups: copies of pieces launched on other workers (``backup``).
        late: members whose call was cancelled when the step went on without them (drop,
            or another copy of the piece answered first), with the seconds that call had
            run (the longest, if several).
    """

    results: dict[int, ShardResult] = field(default_factory=dict)
    rejected: list[tuple[str, int, str]] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)
    backups: int = 0
    late: dict[str, float] = field(default_factory=dict)


class StepPlanner(Protocol):
    """A strategy's step counts and plans: what the prioritized sampler asks of it.

    ``coordinator.training.train_job.StepScheme`` (what the parameter-server loop asks)
    extends it.
    """

    @property
    def per_epoch(self) -> int:
        """Global steps in one epoch (diloco: outer steps)."""
        ...

    @property
    def total(self) -> int:
        """Global steps of the job (diloco: outer steps)."""
        ...

    def plan(
        self, step: int, members: Sequence[str], rates: Mapping[str, float | None]
    ) -> StepPlan:
        """Global step ``step``'s pieces for the active ``members`` (none: one per shard)."""
        ...
