"""Gradient and buffer averaging of a sync or diloco step on the coordinator.

What the parameter server applies (``coordinator.training.parameter_server``): the workers'
gradients (diloco: pseudo-gradients) averaged by sample count, their buffers merged.

Shapes: W workers; each gradient dict maps a parameter name to an array of that parameter's
shape, each buffer dict a buffer name (BatchNorm's running_mean, running_var,
num_batches_tracked) to an array of that buffer's shape and dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from shared.training.models import check_param_arrays


def weighted_average(
    grads: Sequence[dict[str, np.ndarray]], samples: Sequence[int]
) -> dict[str, np.ndarray]:
    """Average per-worker gradients weighted by their sample counts.

    g = sum_w (n_w / N) * g_w with N = sum_w n_w. When each g_w is the gradient of the MEAN
    loss over worker w's n_w rows, g is the gradient of the mean loss over all N rows, i.e.
    single-process training on the concatenated batch (Goyal et al. 2017, "Accurate, Large
    Minibatch SGD", section 2). Workers with n_w = 0 contribute nothing. Accumulates in
    float64.

    Args:
        grads: W dicts name -> array, all with the same names and shapes.
        samples: W sample counts n_w >= 0.

    Returns:
        name -> float32 array, the weighted average.

    Raises:
        ValueError: len(grads) != len(samples), a count is negative, all counts are 0, or
            names/shapes disagree between workers (the message names the parameter).
    """
    expected = check_weighted(grads, samples)
    total = sum(samples)
    terms = [(g, n / total) for g, n in zip(grads, samples, strict=True) if n]
    coeffs = np.array([c for _, c in terms], np.float64)
    out: dict[str, np.ndarray] = {}
    for name in expected:
        parts = [np.asarray(g[name]) for g, _ in terms]
        if all(p.dtype == np.float32 and p.flags.c_contiguous for p in parts):
            # One compiled pass, bit-identical to the loop below. Imported here: numba loads
            # at a job's first aggregation, not at the coordinator's start
            # (tests/unit/test_import_direction.py).
            from coordinator.training.aggregation_kernels import weighted_sum

            flat = np.empty(expected[name], np.float32)
            weighted_sum(flat.reshape(-1), tuple(p.reshape(-1) for p in parts), coeffs)
            out[name] = flat
            continue
        acc = np.zeros(expected[name], np.float64)
        for p, c in zip(parts, coeffs, strict=True):
            acc += float(c) * np.asarray(p, np.float64)
        out[name] = acc.astype(np.float32)
    return out


def check_weighted(
    grads: Sequence[dict[str, np.ndarray]], samples: Sequence[int]
) -> dict[str, tuple[int, ...]]:
    """Check W gradient sets and their sample counts before they are combined.

    Args:
        grads: W dicts name -> array.
        samples: W sample counts.

    Returns:
        name -> shape of every parameter (those of ``grads[0]``).

    Raises:
        ValueError: len(grads) != len(samples), a count is negative, all counts are 0, or
            names/shapes disagree between workers (the message names the parameter).
    """
    if len(grads) != len(samples):
        raise ValueError(f"{len(grads)} gradient sets but {len(samples)} sample counts")
    if any(n < 0 for n in samples):
        raise ValueError(f"sample counts must be >= 0, got {list(samples)}")
    if sum(samples) == 0:
        raise ValueError("cannot combine gradients: every worker reported 0 samples")
    expected = {name: tuple(np.shape(a)) for name, a in grads[0].items()}
    for g in grads[1:]:
        check_param_arrays(g, expected)
    return expected


def average_buffers(
    buffers: Sequence[dict[str, np.ndarray]], samples: Sequence[int]
) -> dict[str, np.ndarray]:
    """Merge the workers' model buffers after one step: floats averaged, integers maxed.

    Float buffers (BatchNorm's running_mean and running_var) are averaged weighted by sample
    count, as ``weighted_average``: each worker updated them from the coordinator's values
    with its own batches' statistics, so the average of running_mean is the running mean of
    the global batch's mean. Integer buffers (num_batches_tracked) take the largest value
    among the workers that had samples: the forward passes of the step's longest shard.

    Args:
        buffers: W dicts name -> array, same names, shapes and dtypes; may be empty dicts.
        samples: W sample counts n_w >= 0, not all 0.

    Returns:
        name -> array of the buffer's dtype.

    Raises:
        ValueError: as ``weighted_average`` (counts, names, shapes).
    """
    if not buffers or not buffers[0]:
        return {}
    first = buffers[0]
    floats = [n for n, a in first.items() if np.issubdtype(np.asarray(a).dtype, np.floating)]
    out = weighted_average([{n: g[n] for n in floats} for g in buffers], samples)
    ints = [n for n in first if n not in out]
    contributed = [b for b, n in zip(buffers, samples, strict=True) if n > 0]
    for name in ints:
        out[name] = np.max([np.asarray(b[name]) for b in contributed], axis=0)
    return {n: out[n].astype(np.asarray(first[n]).dtype, copy=False) for n in first}
