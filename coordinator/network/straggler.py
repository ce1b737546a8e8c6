"""Stragglers of a sync training job: step deadlines, proportional batch shares, exclusion.

Plain Python and NumPy, no gRPC. Times in seconds; steps are the job's global step numbers.

- ``step_deadline_s``: how long the coordinator waits for a step's gradients, from the recent
  step times of the healthy workers (median and MAD).
- ``StepTimes``: the bounded window of those step times.
- ``proportional_shares``: the rows of a global batch split by the workers' samples/s.
- ``Exclusion``: which workers sit out, on probation, and when they come back on trial.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Literal

import numpy as np

# 1 / Phi^-1(3/4): scales the MAD to the standard deviation of a normal distribution.
MAD_TO_SIGMA = 1.4826
# Deviations beyond which a step time is unusual (Leys et al. 2013 recommend 2.5 to 3).
MAD_SIGMAS = 3.0


def step_deadline_s(
    recent_step_s: Sequence[float], factor: float, floor_s: float, cap_s: float
) -> float:
    """The deadline of the next step: a multiple of the median, widened by the spread.

    d = clamp(max(factor * m, m + 3 * 1.4826 * MAD), floor_s, cap_s), with m the median of
    the recent step times and MAD = median(|t - m|) (Hampel 1974, "The influence curve and
    its role in robust estimation", JASA 69; 1.4826 makes the MAD a consistent estimate of a
    normal distribution's standard deviation, so m + 3 * 1.4826 * MAD is the robust
    three-sigma bound of Leys et al. 2013, "Detecting outliers: do not use standard deviation
    around the mean, use absolute deviation around the median"). The multiple covers steady
    jobs whose times barely vary (MAD near 0); the spread term covers jittery links, where a
    fixed multiple would cut off ordinary steps. Median and MAD ignore a few stragglers in
    the window, so the stragglers themselves cannot stretch the deadline.

    Args:
        recent_step_s: recent wall seconds of healthy workers' steps (``StepTimes.values``),
            each finite and >= 0; may be empty.
        factor: multiple of the median, >= 1.
        floor_s: the shortest deadline, seconds, >= 0.
        cap_s: the longest deadline (the job's step timeout), seconds, >= floor_s.

    Returns:
        Seconds; cap_s when there is no history yet.

    Raises:
        ValueError: factor < 1, floor_s < 0, cap_s < floor_s, or a step time negative or not
            finite.
    """
    if not (math.isfinite(factor) and factor >= 1):
        raise ValueError(f"factor must be a finite number >= 1, got {factor}")
    if not (0 <= floor_s <= cap_s and math.isfinite(cap_s)):
        raise ValueError(f"need 0 <= floor_s <= cap_s (finite), got {floor_s} and {cap_s}")
    times = np.asarray(recent_step_s, np.float64)
    if times.size and not (np.all(np.isfinite(times)) and np.all(times >= 0)):
        raise ValueError(f"step times must be finite and >= 0, got {list(recent_step_s)}")
    if times.size == 0:
        return float(cap_s)
    median = float(np.median(times))
    mad = float(np.median(np.abs(times - median)))
    deadline = max(factor * median, median + MAD_SIGMAS * MAD_TO_SIGMA * mad)
    return float(min(cap_s, max(floor_s, deadline)))


class StepTimes:
    """The last ``size`` step wall times of healthy workers, seconds, oldest first."""

    def __init__(self, size: int = 20) -> None:
        """Start empty; ValueError if size < 1."""
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self._times: deque[float] = deque(maxlen=size)

    def add(self, step_s: float) -> None:
        """Append one step time, dropping the oldest when full (ValueError: < 0 or not finite)."""
        if not (math.isfinite(step_s) and step_s >= 0):
            raise ValueError(f"step_s must be a finite number >= 0, got {step_s}")
        self._times.append(float(step_s))

    def values(self) -> list[float]:
        """The window's step times, oldest first."""
        return list(self._times)

    def __len__(self) -> int:
        return len(self._times)


def _measured(rate: float | None) -> bool:
    return rate is not None and math.isfinite(rate) and rate > 0


def proportional_shares(total_rows: int, rates: Mapping[str, float | None]) -> dict[str, int]:
    """Split a global batch's rows over the workers in proportion to their samples/s.

    Hamilton's largest-remainder method (Balinski and Young, "Fair Representation", 1982):
    each worker first gets floor(q_w) of its quota q_w = total_rows * r_w / sum(r), then the
    rows left go one each to the largest fractional parts q_w - floor(q_w), ties to the name
    that sorts first. Quotas are exact rationals (``fractions.Fraction``), so the parts sum to
    total_rows exactly and equal rates tie exactly: equal rates give ``numpy.array_split``'s
    sizes in name order. An unmeasured rate (None, 0 or NaN) counts as the median of the
    measured ones, all equal when none is measured: a new worker starts with an average
    share and is measured on it. When total_rows >= the number of workers, a worker left
    with 0 rows takes one from the worker with the most (ties: the lower rate, then the
    later name), so every worker is measured every step. Faster never gets fewer rows.

    Args:
        rates: worker name -> samples/s (``WorkerLink.samples_per_s``), finite, >= 0 or NaN
            or None.
        total_rows: rows of the step's global batch, >= 0.

    Returns:
        name -> rows, the same names, values summing to total_rows.

    Raises:
        ValueError: total_rows < 0, a rate negative or infinite, or rows but no workers.
    """
    if total_rows < 0:
        raise ValueError(f"total_rows must be >= 0, got {total_rows}")
    bad = {n: r for n, r in rates.items() if r is not None and (r < 0 or math.isinf(r))}
    if bad:
        raise ValueError(f"rates must be finite and >= 0, got {bad}")
    if not rates:
        if total_rows:
            raise ValueError(f"cannot split {total_rows} rows over no workers")
        return {}
    names = sorted(rates)
    measured = [float(r) for r in rates.values() if r is not None and _measured(r)]
    fill = float(np.median(measured)) if measured else 1.0
    exact = {n: Fraction(r if r is not None and _measured(r) else fill) for n, r in rates.items()}
    total_rate = sum(exact.values())
    quota = {n: total_rows * exact[n] / total_rate for n in names}
    rows = {n: math.floor(quota[n]) for n in names}
    left = total_rows - sum(rows.values())
    by_remainder = sorted(names, key=lambda n: (-(quota[n] - rows[n]), n))
    for n in by_remainder[:left]:
        rows[n] += 1
    if total_rows >= len(names):
        for n in names:
            if rows[n] == 0:
                donor = max(names, key=lambda d: (rows[d], -exact[d], d))
                rows[donor] -= 1
                rows[n] = 1
    return {n: rows[n] for n in names}


State = Literal["included", "excluded", "trial"]


@dataclass
class _Worker:
    state: State
    probation_steps: int
    until: int = 0
    reason: str | None = None


class Exclusion:
    """Which workers a job leaves out: exclusion, probation, and re-admission on trial.

    A worker whose health falls below ``threshold`` is excluded for ``probation_steps``
    steps (unless it is the last included worker: a job never excludes everyone). Then it
    is re-admitted on trial: it computes again, and its health, whose failure and rejection
    terms decay per step (``link_stats.health``), has ``trial_steps`` steps to climb back.
    If it is still below the threshold at the end of the trial it is excluded again for
    twice its previous probation (20, 40, 80 ... steps: a worker that keeps failing costs
    the job less and less); if it is above, it is included and its probation resets.

    The caller calls ``update`` once per step for every worker, excluded ones included (that
    is how their probation ends).
    """

    def __init__(
        self, threshold: float = 0.3, probation_steps: int = 20, trial_steps: int = 3
    ) -> None:
        """Start with every worker included.

        Args:
            threshold: health below which a worker is excluded, in [0, 1].
            probation_steps: steps of a first exclusion, >= 1.
            trial_steps: steps a re-admitted worker has to recover, >= 1.

        Raises:
            ValueError: an argument out of range.
        """
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if probation_steps < 1 or trial_steps < 1:
            raise ValueError(
                f"probation_steps and trial_steps must be >= 1, got {probation_steps}, "
                f"{trial_steps}"
            )
        self.threshold = threshold
        self.probation_steps = probation_steps
        self.trial_steps = trial_steps
        self._workers: dict[str, _Worker] = {}

    def update(
        self, name: str, health: float, step: int, others_included: int, detail: str = ""
    ) -> Literal["excluded", "readmitted"] | None:
        """Advance one worker's state at a step; return the event, if any.

        Args:
            name: the worker.
            health: its health now, in [0, 1] (``link_stats.health``).
            step: the job's global step number (non-decreasing between calls).
            others_included: how many OTHER workers of the job are included (trial counts as
                included), >= 0; with 0 this worker is never excluded.
            detail: what the reason adds in parentheses, e.g. ``WorkerLink.describe()``.

        Returns:
            ``excluded`` (it sits out from this step), ``readmitted`` (it computes again from
            this step, on trial), or None.

        Raises:
            ValueError: health outside [0, 1] or NaN, or others_included < 0.
        """
        if not 0.0 <= health <= 1.0:
            raise ValueError(f"health must be in [0, 1], got {health}")
        if others_included < 0:
            raise ValueError(f"others_included must be >= 0, got {others_included}")
        worker = self._workers.setdefault(name, _Worker("included", self.probation_steps))
        if worker.state == "excluded":
            if step < worker.until:
                return None
            worker.state, worker.until, worker.reason = "trial", step + self.trial_steps, None
            return "readmitted"
        low = health < self.threshold
        if worker.state == "trial":
            if step < worker.until:
                return None
            if not low:
                worker.state, worker.probation_steps = "included", self.probation_steps
                return None
            if others_included == 0:
                return None  # stays on trial: excluded as soon as another worker is back
            worker.probation_steps *= 2
        elif not low or others_included == 0:
            return None
        worker.state, worker.until = "excluded", step + worker.probation_steps
        worker.reason = f"health {health:.2f} < {self.threshold:.2f} at step {step}"
        if detail:
            worker.reason += f" ({detail})"
        return "excluded"

    def state(self, name: str) -> State:
        """``included``, ``excluded`` or ``trial`` (unknown workers are included)."""
        worker = self._workers.get(name)
        return "included" if worker is None else worker.state

    def excluded(self, name: str) -> bool:
        """Whether the worker sits out now (a worker on trial does not)."""
        return self.state(name) == "excluded"

    def reason(self, name: str) -> str | None:
        """Why the worker is excluded, e.g. ``health 0.12 < 0.30 at step 40 (rtt 210 ms)``."""
        worker = self._workers.get(name)
        return worker.reason if worker is not None and worker.state == "excluded" else None

    def excluded_reasons(self) -> dict[str, str]:
        """The reason of every excluded worker by name (for ``LinkStats.to_doc``)."""
        return {n: w.reason for n, w in self._workers.items() if w.reason is not None}

    def forget(self, name: str) -> None:
        """Drop a worker that left the job; no error when unknown."""
        self._workers.pop(name, None)
