"""Evaluating a model on a job's test split (on the coordinator's CPU)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

EVAL_BATCH = 1024


@torch.no_grad()
def evaluate(
    model: nn.Module, x_test: npt.NDArray[np.float32], y_test: npt.NDArray[np.int64]
) -> tuple[float, float]:
    """Mean cross-entropy (nats) and accuracy in [0, 1] of ``model`` in eval mode.

    BatchNorm layers use their running statistics; the model is put back in training mode.

    Args:
        model: on CPU, float32.
        x_test: [T, *input_shape] float32.
        y_test: [T] int64 labels.
    """
    x_all, y_all = torch.from_numpy(x_test), torch.from_numpy(y_test)
    loss_sum, correct = 0.0, 0
    model.eval()
    try:
        for i in range(0, len(y_all), EVAL_BATCH):
            x, y = x_all[i : i + EVAL_BATCH], y_all[i : i + EVAL_BATCH]
            logits = model(x)
            loss_sum += float(nn.functional.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(dim=1) == y).sum())
    finally:
        model.train()
    n = max(len(y_all), 1)
    return loss_sum / n, correct / n
