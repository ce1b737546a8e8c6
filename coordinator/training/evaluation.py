"""Evaluating a model on a job's test split (on the coordinator's CPU)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from torch import nn

from shared.training.tasks import Task
from shared.training.tasks import evaluate as evaluate_task

EVAL_BATCH = 1024


def evaluate(
    model: nn.Module, x_test: npt.NDArray[Any], y_test: npt.NDArray[Any], task: Task
) -> dict[str, float]:
    """The task's test metrics of ``model`` in eval mode (``shared.training.tasks.evaluate``).

    BatchNorm layers use their running statistics; the model is put back in training mode.

    Args:
        model: on CPU, float32.
        x_test: [T, *input_shape] the test inputs.
        y_test: [T, ...] the test targets.
        task: the job's task.

    Returns:
        ``test_loss`` (mean per-sample loss) and the task's metrics: ``test_accuracy``
        (classification), ``test_mse``, ``test_mae``, ``test_r2`` (regression),
        ``test_perplexity`` (language_model).
    """
    return evaluate_task(task, model, np.asarray(x_test), np.asarray(y_test), EVAL_BATCH)
