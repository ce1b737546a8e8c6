"""Evaluating a model on a job's test split (on the coordinator's CPU)."""

from __future__ import annotations

from torch import nn

from shared.training.data import TrainSource
from shared.training.tasks import Task, evaluate_batches

EVAL_BATCH = 1024


def evaluate(model: nn.Module, source: TrainSource, task: Task) -> dict[str, float]:
    """The task's test metrics of ``model`` in eval mode (``shared.training.tasks``).

    The test rows are read ``EVAL_BATCH`` at a time (a file set's from its mapped files).
    BatchNorm layers use their running statistics; the model is put back in training mode.

    Args:
        model: on CPU, float32.
        source: the job's data set; its test rows.
        task: the job's task.

    Returns:
        ``test_loss`` (mean per-sample loss) and the task's metrics: ``test_accuracy``
        (classification), ``test_mse``, ``test_mae``, ``test_r2`` (regression),
        ``test_perplexity`` (language_model).
    """
    return evaluate_batches(task, model, source.test_batches(EVAL_BATCH))
