"""Per-worker link telemetry of a sync training job: smoothed RTT, bandwidth, step times, health.

The coordinator observes each worker from its side of the wire: the wall time of every
ComputeGradients call, the compute time the worker reports, the bytes each way, RTT probes,
failed calls and rejected gradients. Times are smoothed by an exponentially weighted moving
average, e = alpha * x + (1 - alpha) * e (NIST/SEMATECH e-Handbook of Statistical Methods,
6.4.3.1; TCP's smoothed RTT, RFC 6298 section 2, is the same filter with alpha = 1/8). The
first sample initialises e, as RFC 6298 does, so a fresh estimate is not biased toward 0.

Plain Python, no gRPC; one event loop owns it (not thread-safe).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any


def ewma(previous: float | None, sample: float, alpha: float) -> float:
    """One step of the EWMA e = alpha * x + (1 - alpha) * e; the first sample starts it.

    Args:
        previous: the current average, None before the first sample.
        sample: the new observation x.
        alpha: weight of the new observation, in (0, 1].
    """
    return sample if previous is None else alpha * sample + (1.0 - alpha) * previous


def _check_amount(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


class WorkerLink:
    """What the coordinator measured of one worker: EWMAs, counters and decaying recents.

    Attributes (EWMAs are None until measured):
        rtt_s: round-trip time of a probe, seconds.
        bandwidth_bps: bytes moved per second of a step's non-compute time, bytes/s. A lower
            bound of the link's bandwidth: that time also holds latency and (de)serialisation.
        step_s: wall seconds of one ComputeGradients call, as seen by the coordinator.
        compute_s: seconds the worker reports it computed.
        transfer_s: step_s - compute_s of each step, clamped at 0 (clocks differ), seconds.
        samples_per_s: rows per wall second of a step, for throughput-proportional batches.
        steps, failures, rejected: counts of steps observed, failed calls, and gradients
            rejected (non-finite or norm outlier).
        bytes_up, bytes_down: bytes received from the worker (gradients) and sent to it
            (parameters), totals.
        failures_recent, rejected_recent: the counts with every earlier event multiplied by
            ``decay`` per step observed, so a worker that recovers regains its health.
    """

    def __init__(self, alpha: float = 0.3, decay: float = 0.9) -> None:
        """Start with nothing measured.

        Args:
            alpha: EWMA weight of a new sample, in (0, 1].
            decay: factor applied to the recent failure and rejection counts per step
                observed, in [0, 1).

        Raises:
            ValueError: alpha or decay out of range.
        """
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        self.alpha = alpha
        self.decay = decay
        self.rtt_s: float | None = None
        self.bandwidth_bps: float | None = None
        self.step_s: float | None = None
        self.compute_s: float | None = None
        self.transfer_s: float | None = None
        self.samples_per_s: float | None = None
        self.steps = 0
        self.failures = 0
        self.rejected = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.failures_recent = 0.0
        self.rejected_recent = 0.0

    def observe_step(
        self, wall_s: float, compute_s: float, bytes_up: int, bytes_down: int, samples: int
    ) -> None:
        """Record one completed ComputeGradients call; decay the recent failures/rejections.

        Bandwidth is (bytes_up + bytes_down) / transfer seconds, skipped when either is 0;
        samples/s is samples / wall_s, skipped for an empty shard or a zero wall time.

        Args:
            wall_s: seconds from sending the request to holding the whole reply.
            compute_s: seconds the worker reports for its forward and backward passes.
            bytes_up: bytes of the reply (gradients), >= 0.
            bytes_down: bytes of the request (parameters), >= 0.
            samples: rows the worker computed on, >= 0.

        Raises:
            ValueError: a value is negative or not finite; nothing is recorded.
        """
        for name, value in (("wall_s", wall_s), ("compute_s", compute_s)):
            _check_amount(name, value)
        for name, count in (
            ("bytes_up", bytes_up),
            ("bytes_down", bytes_down),
            ("samples", samples),
        ):
            _check_amount(name, count)
        transfer_s = max(0.0, wall_s - compute_s)
        self.step_s = ewma(self.step_s, wall_s, self.alpha)
        self.compute_s = ewma(self.compute_s, compute_s, self.alpha)
        self.transfer_s = ewma(self.transfer_s, transfer_s, self.alpha)
        moved = bytes_up + bytes_down
        if moved > 0 and transfer_s > 0:
            self.bandwidth_bps = ewma(self.bandwidth_bps, moved / transfer_s, self.alpha)
        if samples > 0 and wall_s > 0:
            self.samples_per_s = ewma(self.samples_per_s, samples / wall_s, self.alpha)
        self.steps += 1
        self.bytes_up += bytes_up
        self.bytes_down += bytes_down
        self.failures_recent *= self.decay
        self.rejected_recent *= self.decay

    def observe_rtt(self, rtt_s: float) -> None:
        """Record one round-trip probe, seconds (finite, >= 0; ValueError otherwise)."""
        _check_amount("rtt_s", rtt_s)
        self.rtt_s = ewma(self.rtt_s, rtt_s, self.alpha)

    def observe_failure(self) -> None:
        """Record a failed call (error, timeout, or a deadline missed)."""
        self.failures += 1
        self.failures_recent += 1.0

    def observe_rejected(self) -> None:
        """Record a gradient rejected as non-finite or as a norm outlier."""
        self.rejected += 1
        self.rejected_recent += 1.0

    def describe(self) -> str:
        """A short account for an exclusion reason, e.g. ``rtt 210 ms, 3 rejected gradients``.

        Only what was measured or counted appears; empty when nothing was.
        """
        parts = []
        if self.rtt_s is not None:
            parts.append(f"rtt {self.rtt_s * 1e3:.0f} ms")
        if self.step_s is not None:
            parts.append(f"step {self.step_s * 1e3:.0f} ms")
        if self.failures:
            parts.append(f"{self.failures} failed calls")
        if self.rejected:
            parts.append(f"{self.rejected} rejected gradients")
        return ", ".join(parts)

    def to_doc(
        self,
        median_step_s: float | None = None,
        excluded: bool = False,
        excluded_reason: str | None = None,
    ) -> dict[str, Any]:
        """A JSON-serialisable summary (None where unmeasured, never NaN), for status views.

        Args:
            median_step_s: the job's median step time, seconds, for ``health``.
            excluded: whether the job excludes this worker now (``straggler.Exclusion``).
            excluded_reason: why, when excluded.

        Returns:
            Keys rtt_ms, bandwidth_mbit (megabits/s), step_ms, compute_ms, transfer_ms,
            samples_per_s, steps, failures, rejected, bytes_up, bytes_down, health (in
            [0, 1]), excluded, excluded_reason.
        """

        def scaled(value: float | None, factor: float) -> float | None:
            return None if value is None else value * factor

        return {
            "rtt_ms": scaled(self.rtt_s, 1e3),
            "bandwidth_mbit": scaled(self.bandwidth_bps, 8e-6),
            "step_ms": scaled(self.step_s, 1e3),
            "compute_ms": scaled(self.compute_s, 1e3),
            "transfer_ms": scaled(self.transfer_s, 1e3),
            "samples_per_s": self.samples_per_s,
            "steps": self.steps,
            "failures": self.failures,
            "rejected": self.rejected,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "health": health(self, median_step_s),
            "excluded": excluded,
            "excluded_reason": excluded_reason if excluded else None,
        }


def health(link: WorkerLink, median_step_s: float | None) -> float:
    """A worker's health in [0, 1]: speed x reliability x integrity.

    speed = min(1, median_step_s / step_s), 1 while either is unmeasured: a worker as fast as
    the job's median or faster is not penalised, one twice as slow scores 0.5.
    reliability = 1 / (1 + failures_recent) and integrity = 1 / (1 + 2 * rejected_recent):
    one recent failure halves the score, one recent rejected gradient divides it by 3 (a
    wrong gradient costs more than a late one: it would have moved the model). Both recents
    decay by ``decay`` per step observed, so a recovered worker's health climbs back to 1.

    Args:
        link: the worker's telemetry.
        median_step_s: the median of the job's (healthy) workers' smoothed step times,
            seconds; None or <= 0: unmeasured.

    Returns:
        The score, 1.0 for a worker about which nothing bad is known.
    """
    speed = 1.0
    if median_step_s is not None and median_step_s > 0 and link.step_s:
        speed = min(1.0, median_step_s / link.step_s)
    reliability = 1.0 / (1.0 + link.failures_recent)
    integrity = 1.0 / (1.0 + 2.0 * link.rejected_recent)
    return speed * reliability * integrity


class LinkStats:
    """The telemetry of a job's workers by name; ``get`` creates a worker's on first use."""

    def __init__(self, alpha: float = 0.3, decay: float = 0.9) -> None:
        """Start empty; every WorkerLink is made with this alpha and decay (see WorkerLink)."""
        WorkerLink(alpha, decay)  # validates both now rather than at the first get()
        self.alpha = alpha
        self.decay = decay
        self._links: dict[str, WorkerLink] = {}
        # name -> reason, for the workers a running train job excludes now (status shows it)
        self.excluded: dict[str, str] = {}

    def get(self, name: str) -> WorkerLink:
        """The worker's link, created empty the first time."""
        link = self._links.get(name)
        if link is None:
            link = self._links[name] = WorkerLink(self.alpha, self.decay)
        return link

    def remove(self, name: str) -> None:
        """Forget a worker (it left the job); no error when unknown."""
        self._links.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._links

    def __iter__(self) -> Iterator[str]:
        return iter(self._links)

    def __len__(self) -> int:
        return len(self._links)

    def median_step_s(self, names: Iterable[str] | None = None) -> float | None:
        """Median of the smoothed step times of ``names`` (default all), seconds; None if none."""
        chosen = self._links if names is None else names
        times = sorted(
            s for n in chosen if n in self._links and (s := self._links[n].step_s) is not None
        )
        if not times:
            return None
        mid = len(times) // 2
        return times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2

    def health(self, name: str, healthy: Iterable[str] | None = None) -> float:
        """``health`` of one worker against the median step time of ``healthy`` (default all)."""
        return health(self.get(name), self.median_step_s(healthy))

    def to_doc(self, excluded: Mapping[str, str] | None = None) -> dict[str, dict[str, Any]]:
        """Every worker's ``WorkerLink.to_doc``, health against the included workers' median.

        Args:
            excluded: name -> reason of the workers excluded now.
        """
        excluded = excluded or {}
        median = self.median_step_s(n for n in self._links if n not in excluded)
        return {
            name: link.to_doc(median, name in excluded, excluded.get(name))
            for name, link in self._links.items()
        }
