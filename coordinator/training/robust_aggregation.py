"""Robust gradient aggregation: rejection of non-finite and outlier gradients, and robust means.

Plain NumPy, no gRPC and no torch of its own (``aggregate(method="mean")`` calls
``coordinator.training.aggregation.weighted_average``, whose module loads torch; the coordinator
has it loaded anyway). Accumulation is float64, results are float32.

Shapes: W workers; P the number of scalars of one parameter. A gradient dict maps a parameter
name to an array of that parameter's shape; ``grads_WP`` stacks one parameter's gradients of
the W workers, flattened.

Weights: every worker w carries a sample count n_w. The caller should pass the number of rows
the coordinator assigned (not a count the worker reports), so a faulty worker cannot buy
itself weight. Workers with n_w = 0 are left out of every method (as in ``weighted_average``)
and do not count in W for trimming.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import numpy as np

from coordinator.training.aggregation import check_weighted, weighted_average

Method = Literal["mean", "trimmed_mean", "median"]
METHODS: tuple[Method, ...] = ("mean", "trimmed_mean", "median")


def nonfinite_names(grads: dict[str, np.ndarray]) -> list[str]:
    """Names of the parameters whose gradient holds a NaN or an infinity.

    Args:
        grads: name -> array of any float dtype and shape (one worker's gradients).

    Returns:
        The offending names in the dict's order; empty when every value is finite.
    """
    return [name for name, g in grads.items() if not np.all(np.isfinite(g))]


def global_norm(grads: dict[str, np.ndarray]) -> float:
    """The L2 norm of all of one worker's gradients taken as one vector.

    ||g|| = sqrt(sum_name sum_i g[name]_i ** 2), the norm ``torch.nn.utils.clip_grad_norm_``
    clips (its ``norm_type=2``). Squares are accumulated in float64, so float32 gradients of
    large models neither overflow nor lose small terms.

    Args:
        grads: name -> array of any float dtype and shape.

    Returns:
        The norm (>= 0); 0.0 for an empty dict; inf or nan when a value is not finite.
    """
    total = 0.0
    for g in grads.values():
        a = np.asarray(g, np.float64).ravel()
        total += float(np.dot(a, a))
    return math.sqrt(total)


def norm_outliers(norms: Sequence[float], max_ratio: float) -> list[int]:
    """Indices of the workers whose gradient norm is far from the median norm.

    Worker w is an outlier when norm_w > max_ratio * m or norm_w < m / max_ratio, with m the
    median of the finite norms given (a multiplicative band around the median: the median
    cannot be dragged by fewer than half of the workers, Hampel 1974, and a ratio fits a
    quantity whose scale changes by orders of magnitude during training). A non-finite norm
    is always an outlier (3 or more workers). With fewer than 3 workers nothing is rejected:
    the median of two norms is their mean, so each is exactly as far from it as the other,
    and there is no majority to tell which one is wrong.

    Args:
        norms: W global L2 norms (``global_norm``), >= 0.
        max_ratio: the band's ratio, > 1 (e.g. 10: ten times larger or smaller).

    Returns:
        The outliers' indices, ascending; empty when W < 3.

    Raises:
        ValueError: max_ratio <= 1 (or not finite), or a norm is negative.
    """
    if not (math.isfinite(max_ratio) and max_ratio > 1):
        raise ValueError(f"max_ratio must be a finite number > 1, got {max_ratio}")
    if any(n < 0 for n in norms):
        raise ValueError(f"gradient norms must be >= 0, got {list(norms)}")
    if len(norms) < 3:
        return []
    finite = [n for n in norms if math.isfinite(n)]
    if not finite:
        return list(range(len(norms)))
    median = float(np.median(np.asarray(finite, np.float64)))
    return [
        i
        for i, n in enumerate(norms)
        if not math.isfinite(n) or n > max_ratio * median or n < median / max_ratio
    ]


def aggregate(
    grads: Sequence[dict[str, np.ndarray]],
    samples: Sequence[int],
    method: Method,
    trim: float = 0.0,
) -> dict[str, np.ndarray]:
    """Combine the workers' gradients into one: weighted mean, trimmed mean or median.

    - ``mean``: g = sum_w (n_w / N) g_w (``weighted_average``, Goyal et al. 2017).
    - ``trimmed_mean``: coordinate-wise trimmed mean (Yin et al. 2018, "Byzantine-robust
      distributed learning: towards optimal statistical rates", definition 2). For each
      coordinate, the k = floor(trim * W) largest and the k smallest values are removed,
      each with its worker's weight n_w, and the rest are averaged weighted by n_w. The
      textbook estimator is unweighted; weighting keeps it the gradient of the mean loss
      over the kept rows when shards differ in size, and makes trim = 0 exactly ``mean``.
      Values that tie are removed in worker order (a stable sort).
    - ``median``: coordinate-wise median (Yin et al. 2018, definition 1), weighted by n_w:
      the smallest value whose cumulative weight reaches half of N, or the mean of it and
      the next value when the cumulative weight equals N / 2 exactly. With equal n_w this
      is ``numpy.median``.

    Few workers: W = 1 returns that worker's gradients (float32) for every method. W = 2:
    ``trimmed_mean`` trims nothing (k = floor(2 * trim) = 0 for trim < 0.5) so it is the
    weighted mean; ``median`` is the weighted mean when n_0 = n_1, else the gradient of the
    worker with more samples. Robustness needs W >= 3 (a trimmed mean with k >= 1 needs
    W >= 1 / trim).

    Non-finite values are not checked here (``nonfinite_names`` rejects them first): ``mean``
    propagates them, the sorting methods sort NaN above +inf.

    Args:
        grads: W dicts name -> array, all with the same names and shapes.
        samples: W sample counts n_w >= 0, not all 0.
        method: ``mean``, ``trimmed_mean`` or ``median``.
        trim: fraction trimmed from EACH end per coordinate, 0 <= trim < 0.5; only
            ``trimmed_mean`` uses it, but it is checked for every method.

    Returns:
        name -> float32 array of the parameter's shape, the names of ``grads[0]``.

    Raises:
        ValueError: unknown method, trim outside [0, 0.5), len(grads) != len(samples), a
            count is negative, all counts are 0, or names/shapes disagree between workers
            (the message names the parameter).
    """
    if method not in METHODS:
        raise ValueError(f"unknown aggregation method {method!r}; expected one of {METHODS}")
    if not (0.0 <= trim < 0.5):
        raise ValueError(f"trim must be in [0, 0.5), got {trim}")
    if method == "mean":
        return weighted_average(grads, samples)
    expected = check_weighted(grads, samples)
    kept = [(g, n) for g, n in zip(grads, samples, strict=True) if n > 0]
    weights_W = np.asarray([n for _, n in kept], np.int64)
    k = math.floor(trim * len(kept))
    out: dict[str, np.ndarray] = {}
    for name, shape in expected.items():
        grads_WP = np.stack([np.asarray(g[name], np.float64).ravel() for g, _ in kept])
        if method == "trimmed_mean":
            flat = trimmed_mean_WP(grads_WP, weights_W, k)
        else:
            flat = weighted_median_WP(grads_WP, weights_W)
        out[name] = flat.reshape(shape).astype(np.float32)
    return out


def trimmed_mean_WP(grads_WP: np.ndarray, weights_W: np.ndarray, k: int) -> np.ndarray:
    """Per column, drop the k smallest and k largest values with their weights; weighted mean.

    Args:
        grads_WP: [W, P] float64.
        weights_W: [W] int64, > 0.
        k: values removed from each end, 0 <= 2k < W.

    Returns:
        [P] float64.
    """
    order_WP = np.argsort(grads_WP, axis=0, kind="stable")
    sorted_WP = np.take_along_axis(grads_WP, order_WP, axis=0)
    w_WP = weights_W.astype(np.float64)[order_WP]
    end = grads_WP.shape[0] - k
    kept_w = w_WP[k:end]
    return np.asarray((sorted_WP[k:end] * kept_w).sum(axis=0) / kept_w.sum(axis=0))


def weighted_median_WP(grads_WP: np.ndarray, weights_W: np.ndarray) -> np.ndarray:
    """Per column, the weighted median: the value where the cumulative weight reaches half.

    With C_i the cumulative weight of the i smallest values and N the total, the median is
    the first value with 2 C_i >= N, averaged with the next one when 2 C_i = N exactly (so
    equal weights give ``numpy.median``). Integer weights make the comparison exact.

    Args:
        grads_WP: [W, P] float64.
        weights_W: [W] int64, > 0.

    Returns:
        [P] float64.
    """
    order_WP = np.argsort(grads_WP, axis=0, kind="stable")
    sorted_WP = np.take_along_axis(grads_WP, order_WP, axis=0)
    cum_WP = np.cumsum(weights_W[order_WP], axis=0)
    total = int(weights_W.sum())
    first_P = np.argmax(2 * cum_WP >= total, axis=0)[np.newaxis, :]
    at_half_P = (2 * np.take_along_axis(cum_WP, first_P, axis=0) == total)[0]
    nxt_P = np.minimum(first_P + 1, grads_WP.shape[0] - 1)
    low_P = np.take_along_axis(sorted_WP, first_P, axis=0)[0]
    high_P = np.take_along_axis(sorted_WP, nxt_P, axis=0)[0]
    return np.asarray(np.where(at_half_P, (low_P + high_P) / 2, low_P), np.float64)
