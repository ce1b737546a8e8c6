"""A train job's figures per epoch beside its history: convergence, step times, wire, failures.

``convergence`` is the quality improvement ratio L_0 / L_e (README, "The learner"): L_e is
the mean per-sample training loss over epoch e's steps (the history's ``train_loss``: the
loss sum over the samples of the epoch's steps, each computed by a worker at the parameters
the step started from), and L_0 the mean per-sample training loss of the job's first step's
global batch at the initial parameters, before the first update (sync: step 0's loss as the
workers computed it; allreduce: the first step's, all ranks summed; diloco: the first outer
step's, which covers its ``inner_steps`` local steps, so only the first of them is before
any update). Above 1: the loss fell.

Each epoch's entry also gets ``iteration_ms_p50`` and ``iteration_ms_std`` (the median and
population standard deviation of the wall milliseconds of the epoch's steps, as this process
ran them; allreduce: rank 0 reports every 20 steps and each step counts as its report's
mean), ``wire_bytes`` (bytes of the messages the coordinator sent to and received from the
job's workers during the epoch, as serialized protobuf sizes: sync and diloco, parameters
down and gradients up; allreduce, the states and progress it exchanges with the ranks, not
the collectives between workers, which do not pass the coordinator), ``wire_mbit_s`` (those
bytes in megabits over the seconds of the epoch's steps) and ``failures`` (workers the job
lost during the epoch).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def convergence(initial_loss: float, epoch_loss: float) -> float:
    """L_0 / L_e; NaN when either is unknown or L_e is not positive."""
    if not (math.isfinite(initial_loss) and math.isfinite(epoch_loss)) or epoch_loss <= 0:
        return math.nan
    return initial_loss / epoch_loss


class EpochFigures:
    """Counts one epoch's steps at a time; ``end`` gives the epoch entry's fields.

    Attributes:
        initial_loss: L_0, NaN until the job's first step (kept in its checkpoints).
    """

    def __init__(self) -> None:
        """Nothing counted; L_0 unknown."""
        self.initial_loss = math.nan
        self._step_ms: list[float] = []
        self._start: tuple[int, int] | None = None  # (wire bytes, failures) at the epoch's start

    def add_step(self, ms: float, wire_bytes: int, failures: int) -> None:
        """Count a step of the running epoch.

        Args:
            ms: the step's wall milliseconds.
            wire_bytes: the job's bytes on the wire so far, before this step's.
            failures: the job's worker failures so far, before this step's.
        """
        if self._start is None:
            self._start = (wire_bytes, failures)
        self._step_ms.append(ms)

    def set_initial(self, samples: int, loss_sum: float) -> None:
        """Record L_0 from the job's first step: ``loss_sum`` over ``samples`` rows."""
        if samples > 0:
            self.initial_loss = loss_sum / samples

    def end(self, train_loss: float, wire_bytes: int, failures: int) -> dict[str, Any]:
        """The epoch's figures; counting starts anew.

        Args:
            train_loss: L_e, the epoch's mean per-sample training loss.
            wire_bytes: the job's bytes on the wire so far, the epoch's included.
            failures: the job's worker failures so far, the epoch's included.
        """
        ms = np.asarray(self._step_ms, np.float64)
        bytes0, failures0 = self._start if self._start is not None else (wire_bytes, failures)
        seconds = float(ms.sum()) / 1000.0
        moved = wire_bytes - bytes0
        self._step_ms, self._start = [], None
        return {
            "initial_loss": self.initial_loss,
            "convergence": convergence(self.initial_loss, train_loss),
            "iteration_ms_p50": float(np.median(ms)) if len(ms) else math.nan,
            "iteration_ms_std": float(ms.std()) if len(ms) else math.nan,
            "wire_bytes": moved,
            "wire_mbit_s": moved * 8 / 1e6 / seconds if seconds > 0 else math.nan,
            "failures": failures - failures0,
        }
