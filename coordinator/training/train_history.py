"""The per-epoch history of a train job and its best test accuracy so far.

One entry per epoch (the last one possibly partial, when ``steps`` ends the job mid-epoch):
``epoch`` (from 1), ``train_loss`` (mean cross-entropy of the epoch's training rows, nats, as
the workers computed it during the epoch's steps), ``test_loss`` and ``test_accuracy`` (the
model at the epoch's end on the held-out split), ``lr`` (the learning rate of the epoch's last
optimizer step), ``samples_per_s`` (the epoch's training rows over its wall-clock seconds) and
``seconds`` (wall-clock seconds of training from the job's first step to the epoch's end, for
time-to-accuracy).
Kept in the job's checkpoints, so a resumed job's history starts with the epochs already run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

# Entries a progress event carries: enough for ``submit --follow`` to print every epoch even
# when a slow watcher misses events (they are coalesced), without resending a long history.
PROGRESS_ENTRIES = 20


class TrainHistory:
    """Accumulates the running epoch's steps and appends an entry when it ends."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        """An empty history; the first epoch starts now.

        Args:
            clock: seconds (injected by tests).
        """
        self._clock = clock
        self.entries: list[dict[str, Any]] = []
        self.best_test_accuracy = math.nan
        self._samples = 0
        self._loss_sum = 0.0
        self._carried_s = 0.0  # seconds of the running epoch before a checkpoint
        self._t0 = clock()

    def start(self) -> None:
        """Start (or resume) the running epoch's clock: the job's first step comes next.

        Model building and the workers' start-up before it do not count in samples_per_s.
        """
        self._t0 = self._clock() - self._carried_s

    def add_step(self, samples: int, loss_sum: float) -> None:
        """Count one step of the running epoch.

        Args:
            samples: training rows of the step (all shards).
            loss_sum: their summed cross-entropy, nats.
        """
        self._samples += samples
        self._loss_sum += loss_sum

    def end_epoch(self, epoch: int, test_loss: float, test_accuracy: float, lr: float) -> bool:
        """Append the running epoch's entry and start the next epoch.

        Args:
            epoch: the epoch that ended, from 1.
            test_loss: mean cross-entropy on the test split, nats.
            test_accuracy: accuracy on the test split, in [0, 1].
            lr: the learning rate of the epoch's last optimizer step.

        Returns:
            True when ``test_accuracy`` beats every earlier epoch's (the first epoch does).
        """
        now = self._clock()
        before = self.entries[-1].get("seconds", 0.0) if self.entries else 0.0
        self.entries.append(
            {
                "epoch": epoch,
                "train_loss": self._loss_sum / max(self._samples, 1),
                "test_loss": test_loss,
                "test_accuracy": test_accuracy,
                "lr": lr,
                "samples_per_s": self._samples / max(now - self._t0, 1e-9),
                "seconds": before + (now - self._t0),
            }
        )
        self._samples, self._loss_sum, self._t0, self._carried_s = 0, 0.0, now, 0.0
        improved = math.isnan(self.best_test_accuracy) or test_accuracy > self.best_test_accuracy
        if improved:
            self.best_test_accuracy = test_accuracy
        return improved

    def recent(self) -> list[dict[str, Any]]:
        """The last ``PROGRESS_ENTRIES`` entries, for a progress event."""
        return self.entries[-PROGRESS_ENTRIES:]

    def to_doc(self) -> dict[str, Any]:
        """Plain data for a checkpoint: entries, best, and the running epoch so far."""
        return {
            "entries": self.entries,
            "best_test_accuracy": self.best_test_accuracy,
            "samples": self._samples,
            "loss_sum": self._loss_sum,
            "seconds": self._clock() - self._t0,
        }

    def load_doc(self, doc: dict[str, Any]) -> None:
        """Continue from what ``to_doc`` returned (an empty doc: from the start).

        Raises:
            KeyError, TypeError, ValueError: a malformed doc.
        """
        if not doc:
            return
        self.entries = [dict(e) for e in doc["entries"]]
        self.best_test_accuracy = float(doc["best_test_accuracy"])
        self._samples, self._loss_sum = int(doc["samples"]), float(doc["loss_sum"])
        self._carried_s = float(doc["seconds"])
        self.start()
