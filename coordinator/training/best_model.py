"""A train job's best model: kept in memory at each new best, written at checkpoints and the end.

``DATA_DIR/models/JOB.best.pt`` holds the model of the job's best-scoring epoch (the highest
test accuracy; without accuracy the lowest test loss). Writing it at every new best cost the
coordinator a ``torch.save`` of the model (~7 ms for the digits MLP) at most epochs of a
short job, on the same cores as the training (docs/bench-train.md, issue 25); instead the
job keeps a copy of the best epoch's state dict and writes it when it checkpoints (before the
checkpoint, so the best score a checkpoint records is the model's in ``JOB.best.pt``) and when
it ends, succeeded, failed or cancelled (not at a coordinator shutdown, which leaves the job
to resume). Mid-job the file is the best model as of the last checkpoint; a job resumed after
a crash or a shutdown restores the best score of its checkpoint, the score of the model then
in the file, and replaces the file only when a later epoch beats it.
"""

from __future__ import annotations

import io
import threading
from pathlib import Path

import torch
from torch import nn

from shared.logging import get_logger
from shared.private_files import private_dir, write_private

log = get_logger(__name__)


class BestModel:
    """The best epoch's state dict, kept in memory until ``write``.

    ``keep`` and ``write`` may be called from different threads (a job's evaluation thread,
    and at a cancellation the job's cleanup while an evaluation may still run).
    """

    def __init__(self, path: Path) -> None:
        """Nothing kept yet.

        Args:
            path: the job's ``JOB.best.pt`` (``saved_models.model_file(..., best=True)``).
        """
        self.path = path
        self._state: dict[str, torch.Tensor] | None = None  # kept and not yet written
        self._lock = threading.Lock()

    def keep(self, model: nn.Module) -> None:
        """Copy ``model``'s state dict (parameters and buffers, on the CPU) as the best one.

        Args:
            model: the job's model, just evaluated as the best yet.
        """
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        with self._lock:
            self._state = state

    @property
    def pending(self) -> bool:
        """A best model is kept that the file does not hold yet."""
        return self._state is not None

    def write(self) -> None:
        """Write the kept state dict to ``path`` durably; nothing when none is kept.

        A ``torch.save`` of the state dict (load it with ``weights_only=True``). The file is
        replaced atomically (``shared.private_files.write_private``): a crash leaves the old
        best model or the new one.

        Raises:
            OSError: the disk refused the write (the model stays kept, for the next try).
        """
        with self._lock:  # one write at a time; a newer keep meanwhile waits for it
            if self._state is None:
                return
            buf = io.BytesIO()
            torch.save(self._state, buf)
            private_dir(self.path.parent)
            write_private(self.path, buf.getvalue())
            self._state = None

    def write_at_end(self, job_id: str) -> None:
        """``write`` when a job failed or was cancelled: a refused write is logged, not raised.

        The job's own error (or cancellation) is what its record keeps.

        Args:
            job_id: the job, for the log.
        """
        try:
            self.write()
        except OSError as exc:
            log.warning("best_model_not_written", job_id=job_id, error=str(exc))
