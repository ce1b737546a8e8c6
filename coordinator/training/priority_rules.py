"""The formulae of prioritized training (``sampling: prioritized``), plain NumPy.

What ``coordinator.training.prioritized`` computes between a draw and the next, in one place so
that the README, the unit tests and ``tests/prioritized_reference.py`` can pin each:

- a draw's seed (``draw_seed``): the first 8 bytes, little-endian, of
  SHA-256(``"neuroshard-prioritized/{seed}/{epoch}/{step}/{chunk}"``), shifted right by one
  (a seed in [0, 2**63) as the store's sampler takes it);
- the importance-sampling exponent (``annealed_beta``): beta_t = beta + (beta_final - beta)
  min(1, t / (T - 1)), linear from the first step to the last (Schaul et al. 2016, "Prioritized
  Experience Replay", section 3.4: beta annealed to 1 at the end of learning);
- the importance weights (``importance_weights``): w_i = (N P(i))^-beta_t / max_j w_j over the
  draw (Schaul et al. 2016, section 3.4; Katharopoulos and Fleuret 2018, "Not All Samples Are
  Created Equal", for loss-based importance sampling in supervised training), so weights are
  in (0, 1] and only scale the step down;
- a row's strength from its loss (``strengths_of_losses``):
  s = 0.01 + 0.99 (1 - exp(-l / m)), m the running mean of every per-sample loss received so
  far, this step's included (``RunningLoss``). Monotone in l, in [0.01, 1): the store needs
  [0, 1]; relative to the running mean it adapts as training lowers every loss (a row of
  average loss sits at 0.64 whatever the loss's scale); below the mean it is nearly linear
  (s ~ l / m), so P(i) follows loss^alpha as the proportional variant of Schaul et al. does
  with |delta|, while an outlier (a mislabelled row at ten times the mean) saturates at 1
  instead of taking every draw, which bounds max P / min P by 100^alpha and with it the
  spread of the importance weights; the floor 0.01 is Schaul et al.'s epsilon, keeping a row
  of zero loss drawable. Rows never drawn keep their initial strength 1, above any row's
  after a draw, so each row tends to be drawn once early (as new transitions get the
  largest priority). A non-finite loss gives strength 1 and is left out of the mean.

Shape letters: K draws.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np

STRENGTH_FLOOR = 0.01  # the strength of a row of zero loss (Schaul et al.'s epsilon)


def draw_seed(seed: int, epoch: int, step: int, chunk: int = 0) -> int:
    """The sampler's seed of one draw (module docstring): in [0, 2**63).

    Args:
        seed: the job's ``seed``.
        epoch: the epoch of the draw, from 0.
        step: the job's global step the draw is made at (diloco: the window's first outer
            step), from 0.
        chunk: the draw's part, from 0 (a draw of more than ``max_sample_batch`` rows is
            made in parts).
    """
    text = f"neuroshard-prioritized/{seed}/{epoch}/{step}/{chunk}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


def annealed_beta(beta: float, beta_final: float, t: int, total: int) -> float:
    """beta_t, linear from ``beta`` at t = 0 to ``beta_final`` at t = total - 1.

    Args:
        beta: the spec's ``beta``, in [0, 1].
        beta_final: the spec's ``beta_final``, in [0, 1].
        t: the step (diloco: the window's first inner step, job-wide), from 0.
        total: the job's steps (diloco: inner steps per shard), >= 1.
    """
    done = min(1.0, t / max(total - 1, 1))
    return beta + (beta_final - beta) * done


def importance_weights(probabilities: np.ndarray, n_rows: int, beta: float) -> np.ndarray:
    """w_i = (N P(i))^-beta / max_j w_j over the draw (module docstring).

    Args:
        probabilities: [K] float64 P(i) of each draw, each in (0, 1].
        n_rows: N, the rows of the table (the training rows).
        beta: beta_t, in [0, 1].

    Returns:
        [K] float32 in (0, 1]; all 1 when beta is 0.

    Raises:
        ValueError: a probability not in (0, 1], or n_rows < 1.
    """
    p = np.asarray(probabilities, np.float64)
    if n_rows < 1 or not bool(((p > 0) & (p <= 1)).all()):
        raise ValueError("importance_weights: probabilities must be in (0, 1] and N >= 1")
    if len(p) == 0:
        return np.empty(0, np.float32)
    w: np.ndarray = np.power(n_rows * p, -beta)
    return np.asarray(w / w.max(), np.float32)


def strengths_of_losses(losses: np.ndarray, scale: float) -> np.ndarray:
    """S = 0.01 + 0.99 (1 - exp(-l / m)) for each loss (module docstring).

    Args:
        losses: [K] per-sample losses (float32 as the workers send them), >= 0.
        scale: m, the running mean loss (``RunningLoss.mean``), >= 0.

    Returns:
        [K] float32 in [0.01, 1]; 1 for a non-finite loss; 0.01 for every loss when m is 0.
    """
    loss = np.asarray(losses, np.float64)
    finite = np.isfinite(loss)
    safe = np.where(finite, np.maximum(loss, 0.0), 0.0)
    ratio = safe / scale if scale > 0 else np.zeros_like(safe)
    s = STRENGTH_FLOOR + (1.0 - STRENGTH_FLOOR) * -np.expm1(-ratio)  # 1 - exp(-l / m)
    return np.clip(np.where(finite, s, 1.0), 0.0, 1.0).astype(np.float32)


@dataclass
class RunningLoss:
    """The running mean m of every finite per-sample loss received so far.

    Attributes:
        total: their sum, float64.
        count: how many.
    """

    total: float = 0.0
    count: int = 0

    def add(self, losses: np.ndarray) -> None:
        """Add a step's per-sample losses [K] (the non-finite ones are left out)."""
        loss = np.asarray(losses, np.float64)
        finite = loss[np.isfinite(loss)]
        self.total += float(np.sum(finite))
        self.count += len(finite)

    @property
    def mean(self) -> float:
        """m, 0.0 before any loss."""
        return self.total / self.count if self.count else 0.0

    def to_doc(self) -> dict[str, float | int]:
        """As plain data for a checkpoint (``from_doc`` reads it back)."""
        return {"total": self.total, "count": self.count}

    @classmethod
    def from_doc(cls, doc: dict[str, float | int] | None) -> RunningLoss:
        """The running mean a checkpoint saved; a fresh one for None."""
        if not doc:
            return cls()
        total, count = float(doc.get("total", 0.0)), int(doc.get("count", 0))
        return cls(total if math.isfinite(total) else 0.0, max(count, 0))
