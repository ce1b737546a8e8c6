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
from collections.abc import Callable, Mapping
from typing import Any

# Entries a progress event carries: enough for ``submit --follow`` to print every epoch even
# when a slow watcher misses events (they are coalesced), without resending a long history.
PROGRESS_ENTRIES = 20


class TrainHistory:
    """Accumulates the running epoch's steps and appends an entry when it ends."""

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        by_accuracy: bool = True,
        tokens_per_sample: int = 0,
    ) -> None:
        """An empty history; the first epoch starts now.

        Args:
            clock: seconds (injected by tests).
            by_accuracy: the best epoch is the most accurate one (classification); False:
                the one with the lowest test loss (regression, language_model).
            tokens_per_sample: T' of a language model's samples: entries then carry
                ``tokens_per_s``; 0: none.
        """
        self._clock = clock
        self._by_accuracy = by_accuracy
        self._tokens_per_sample = tokens_per_sample
        self.entries: list[dict[str, Any]] = []
        self.best_test_accuracy = math.nan
        self.best_test_loss = math.nan
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

    def end_epoch(
        self,
        epoch: int,
        test_loss: float,
        test_accuracy: float,
        lr: float,
        metrics: Mapping[str, float] | None = None,
    ) -> bool:
        """Append the running epoch's entry and start the next epoch.

        Args:
            epoch: the epoch that ended, from 1.
            test_loss: mean per-sample loss on the test split.
            test_accuracy: accuracy on the test split, in [0, 1] (NaN: not classification).
            lr: the learning rate of the epoch's last optimizer step.
            metrics: the task's other test metrics (``test_mse``, ``test_perplexity``, ...),
                added to the entry.

        Returns:
            True when the epoch is the best yet (the first epoch is): the highest
            ``test_accuracy``, or without accuracy (``by_accuracy`` False) the lowest
            ``test_loss``.
        """
        now = self._clock()
        before = self.entries[-1].get("seconds", 0.0) if self.entries else 0.0
        samples_per_s = self._samples / max(now - self._t0, 1e-9)
        entry = {
            "epoch": epoch,
            "train_loss": self._loss_sum / max(self._samples, 1),
            "test_loss": test_loss,
            "test_accuracy": test_accuracy,
            "lr": lr,
            "samples_per_s": samples_per_s,
            "seconds": before + (now - self._t0),
        }
        entry |= dict(metrics or {})
        if self._tokens_per_sample:
            entry["tokens_per_s"] = samples_per_s * self._tokens_per_sample
        self.entries.append(entry)
        self._samples, self._loss_sum, self._t0, self._carried_s = 0, 0.0, now, 0.0
        if self._by_accuracy:
            improved = (
                math.isnan(self.best_test_accuracy) or test_accuracy > self.best_test_accuracy
            )
        else:
            improved = math.isnan(self.best_test_loss) or test_loss < self.best_test_loss
        if improved:
            self.best_test_accuracy, self.best_test_loss = test_accuracy, test_loss
        return improved

    def recent(self) -> list[dict[str, Any]]:
        """The last ``PROGRESS_ENTRIES`` entries, for a progress event."""
        return self.entries[-PROGRESS_ENTRIES:]

    def to_doc(self) -> dict[str, Any]:
        """Plain data for a checkpoint: entries, best, and the running epoch so far."""
        return {
            "entries": self.entries,
            "best_test_accuracy": self.best_test_accuracy,
            "best_test_loss": self.best_test_loss,
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
        self.best_test_loss = float(doc.get("best_test_loss", math.nan))
        self._samples, self._loss_sum = int(doc["samples"]), float(doc["loss_sum"])
        self._carried_s = float(doc["seconds"])
        self.start()


def history_task(task: str, input_shape: tuple[int, ...]) -> tuple[bool, int]:
    """``TrainHistory``'s task arguments: (by_accuracy, tokens_per_sample).

    Args:
        task: the job's ``task``.
        input_shape: one sample's input shape (language_model: ``(T',)``).
    """
    tokens = int(input_shape[0]) if task == "language_model" and input_shape else 0
    return task == "classification", tokens


def train_accuracy(task: str, correct: int, samples: int) -> float:
    """The share of training rows predicted right (classification); NaN for other tasks."""
    if task != "classification":
        return math.nan
    return correct / max(samples, 1)
