"""The ``memory`` job (docs/architecture.md, "Invariants").

Load memories, then iterations of reinforce from an access stream, decay, quality and top-k
over the whole store, and the iteration's convergence, timed per iteration. Decay, quality and
top-k are one sweep (``MemoryOps.sweep``: one RPC per worker, one pass over its strengths).

Convergence (README, "Memory jobs: convergence and quality"): the window is one iteration.
After iteration i's reinforce and decay, the job reads the strengths of the distinct ids that
iteration reinforced (one ``Get`` routed to their primaries, timed as the ``convergence``
phase) and divides their mean by the table's mean strength from the same sweep
(``shared.memory.stats.convergence_ratio``). Every iteration's progress event carries it and
the table's quality (count, mean, min, max, 10-bin histogram); the coordinator's
``neuroshard_convergence_ratio{job}`` gauge holds the last one.

The coordinator acts as a client of its own store: keyed operations (upsert, reinforce) go
through ``shared.client.memory.MemoryRouter`` fed with the coordinator's current slot map,
the sweep through ``coordinator.memory.memory_ops.MemoryOps``. Given its
seed the job is deterministic: the memories, the Zipf stream and the order of operations are
fixed (``coordinator/memory/access_stream.py``), so the store ends equal to a reference replaying
them.

Resuming after a coordinator restart: the job saves its progress (load done, iterations
completed) in the coordinator's database at most every ``CHECKPOINT_INTERVAL_S`` and at the
end, and a resumed run skips the load and starts at the saved iteration. Each iteration's
reinforce and decay carry ids derived from the job id and the iteration
(``iteration_op_id``; a reinforce the router sends in chunks derives one per chunk,
``shared.client.memory.chunk_request_id``), so an iteration run again (it was cut by the
crash, or completed after the last save) is skipped by every slot that applied it: none is
applied twice.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator.jobs.jobs import JobFailed, JobRecord, JobStore
from coordinator.memory.access_stream import ScrambledZipfStream, TraceStream, generate_memories
from coordinator.memory.memory_ops import BulkOpError, MemoryOps
from coordinator.persistence import StateStore
from coordinator.placement.rebalance import Rebalancer
from shared.client.memory import MemoryRouter, RoutingError
from shared.config import CoordinatorConfig, MemoryJobSpec, TraceAccess
from shared.logging import get_logger
from shared.memory.files import MemoryFileError, load_memories, load_trace
from shared.memory.stats import Quality, convergence_ratio
from shared.memory.validation import validate_rate
from shared.metrics import Metrics
from shared.proto import common_pb2
from shared.security.confinement import PathRefused, with_resolved_paths
from shared.security.transport import ChannelSecurity

log = get_logger(__name__)

UPSERT_BATCH = 100_000  # memories per upsert call while loading
PROGRESS_INTERVAL_S = 0.1  # publish progress at most ~10 times a second
TOPK_SHOWN = 10  # top-k entries kept in the result document
# Timed phases of an iteration: the sweep is decay, quality and top-k in one RPC per worker;
# convergence reads the strengths of the ids the iteration reinforced.
PHASES = ("reinforce", "sweep", "convergence")
CHECKPOINT_INTERVAL_S = 1.0  # progress saved at most this often (and at the end), seconds


def iteration_op_id(job_id: str, iteration: int, phase: str) -> bytes:
    """The request/op id of one phase (``reinforce``, ``decay``) of one iteration of a job.

    The same on every run of the job, so a resumed run's repeat is de-duplicated.
    """
    return f"{job_id}/{iteration}/{phase}".encode()


def skip_batches(stream: ScrambledZipfStream | TraceStream, count: int) -> np.ndarray | None:
    """Draw and drop the first ``count`` batches of ``stream`` (a resumed run's skipped ones).

    Each batch is dropped as soon as the next is drawn, so skipping holds one batch ([B]
    uint64, 8B bytes) at a time whatever ``count`` is.

    Args:
        stream: the job's access stream, not drawn from yet.
        count: iterations completed by earlier runs.

    Returns:
        The last batch drawn ([B] uint64: a run resumed after its last iteration reports that
        iteration's convergence), None when ``count`` is 0.
    """
    last = None
    for i in range(count):
        last = stream.next_batch(i)
    return last


@dataclass
class _Timings:
    """Seconds per phase per iteration, and what the last iteration saw."""

    phase_s: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    iteration_s: list[float] = field(default_factory=list)
    accesses: int = 0
    hits: int = 0
    quality: Quality | None = None
    convergence: float = 0.0
    accessed_mean: float = 0.0  # mean strength of the last iteration's accessed memories
    topk: tuple[np.ndarray, np.ndarray] = (np.empty(0, np.uint64), np.empty(0, np.float32))


class MemoryJob:
    """Runs one memory job; ``run`` returns the result document."""

    def __init__(
        self,
        job: JobRecord,
        cfg: CoordinatorConfig,
        jobs: JobStore,
        rebalancer: Rebalancer,
        memory: MemoryOps,
        security: ChannelSecurity | None = None,
        state: StateStore | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        """Prepare the job; nothing runs until ``run``.

        Args:
            job: a record whose spec is a ``MemoryJobSpec``.
            cfg: the coordinator's config (data roots, ``topk_max``, timeouts in seconds,
                ``max_message_bytes``).
            jobs: where progress is published.
            rebalancer: the owner of the slot map: the job routes keyed operations with its
                ``wire_map`` and waits for it to settle.
            memory: bulk operations (decay, quality, top-k) over the primaries.
            security: TLS and token for the job's own channels to the workers; None for
                plaintext.
            state: where progress is saved and a resumed run finds it; None: not saved
                (the job starts from the load on every run).
            metrics: the coordinator's metrics (``convergence_ratio`` is set per iteration);
                None: not exported.
        """
        assert isinstance(job.spec, MemoryJobSpec)
        self.job, self.spec, self.cfg = job, job.spec, cfg
        self._jobs, self._rebalancer, self._memory = jobs, rebalancer, memory
        self._router = MemoryRouter(
            self._slot_map, cfg.rpc_timeout_s, cfg.max_message_bytes, security=security
        )
        self._last_progress = 0.0
        self._state = state
        self._metrics = metrics
        self._last_checkpoint = 0.0
        loaded, done = state.load_memory_progress(job.job_id) if state else (False, 0)
        self.resumed_at = done if loaded else 0  # iterations completed by earlier runs
        self._loaded = loaded

    async def _slot_map(self) -> common_pb2.SlotMap:
        """The coordinator's current map, as ``GetSlotMap`` would return it."""
        return self._rebalancer.wire_map()

    async def run(self) -> dict[str, Any]:
        """Load, iterate, and return the result document.

        Raises:
            JobFailed: a bad load or trace file (naming the file and array), a top-k larger
                than ``topk_max``, a slot map that did not settle, or a store operation that
                failed after retries.
        """
        try:
            ids, strengths, stream = await asyncio.to_thread(self._prepare)
            # The access stream draws in order: a resumed run skips the batches drawn before.
            skipped = await asyncio.to_thread(skip_batches, stream, self.resumed_at)
            await self._wait_settled()
            load_s = 0.0 if self._loaded else await self._load(ids, strengths)
            self._checkpoint(self.resumed_at, force=True)
            t = await self._iterate(stream, skipped)
        except (RoutingError, BulkOpError) as exc:
            raise JobFailed(f"memory store: {exc}") from None
        finally:
            await self._router.close()
        return self._result(len(np.unique(ids)) if self.spec.load else len(ids), load_s, t)

    def _prepare(self) -> tuple[np.ndarray, np.ndarray, ScrambledZipfStream | TraceStream]:
        """Read or generate the memories and build the access stream (in a thread).

        The spec's paths are confined to the data roots again here (admission did it at
        submission; a symlink may have changed since, or the job was resumed).
        """
        try:
            spec = with_resolved_paths(self.spec, self.cfg.dataset_roots())
        except PathRefused as exc:
            raise JobFailed(str(exc)) from None
        if spec.topk > self.cfg.topk_max:
            raise JobFailed(
                f"topk: {spec.topk} exceeds the coordinator's topk_max {self.cfg.topk_max}"
            )
        try:
            trace = (
                load_trace(spec.access.trace, spec.iterations)
                if isinstance(spec.access, TraceAccess)
                else None
            )
            if spec.load is not None:
                ids, strengths = load_memories(spec.load)
            else:
                ids, strengths = generate_memories(spec.memories, spec.seed)
        except MemoryFileError as exc:
            raise JobFailed(str(exc)) from None
        if trace is not None:
            return ids, strengths, TraceStream(trace)
        assert not isinstance(spec.access, TraceAccess)
        space = np.unique(ids)  # a loaded file may repeat ids; each id gets one rank
        return (
            ids,
            strengths,
            ScrambledZipfStream(space, spec.access.alpha, spec.access.batch, spec.seed),
        )

    async def _wait_settled(self) -> None:
        """Wait until the published map matches the membership and no slot lacks a copy.

        Raises:
            JobFailed: not within ``queue_timeout_s`` (FAILED).
        """
        try:
            await self._rebalancer.wait_settled(self.cfg.queue_timeout_s)
        except TimeoutError as exc:
            raise JobFailed(str(exc)) from None

    async def _load(self, ids: np.ndarray, strengths: np.ndarray) -> float:
        """Upsert every memory in batches; return the seconds it took."""
        t0 = time.perf_counter()
        n = len(ids)
        for start in range(0, n, UPSERT_BATCH):
            end = min(start + UPSERT_BATCH, n)
            await self._router.upsert(ids[start:end], strengths[start:end], None)
            await self._publish({"phase": "load", "loaded": end, "memories": n}, end == n)
        load_s = time.perf_counter() - t0
        log.info("memory_job_loaded", job_id=self.job.job_id, memories=n, seconds=round(load_s, 3))
        return load_s

    async def _convergence(self, accessed: np.ndarray, t: _Timings) -> None:
        """Read the strengths of the distinct ``accessed`` ids ([B] uint64) into ``t``.

        Sets ``t.accessed_mean`` and ``t.convergence`` against ``t.quality`` (the same
        iteration's sweep), and the job's ``neuroshard_convergence_ratio``.
        """
        assert t.quality is not None
        found, strengths, _ = await self._router.get(np.unique(accessed), False)
        hit = strengths[found]
        t.accessed_mean = float(np.mean(hit, dtype=np.float64)) if len(hit) else 0.0
        t.convergence = convergence_ratio(t.accessed_mean, len(hit), t.quality)
        if self._metrics is not None:
            self._metrics.convergence_ratio.labels(self.job.job_id).set(t.convergence)

    async def _iterate(
        self, stream: ScrambledZipfStream | TraceStream, skipped: np.ndarray | None
    ) -> _Timings:
        """Run the iterations: reinforce, one sweep (decay, quality, top-k), convergence.

        Each phase is timed in ``time.perf_counter`` seconds; drawing the access batch is
        not counted.

        Args:
            stream: the access stream, its first ``resumed_at`` batches drawn.
            skipped: the last batch drawn before (``skip_batches``), None on a fresh run.
        """
        spec, t = self.spec, _Timings()
        boosts = np.full(stream.batch, spec.access.boost, np.float32)
        rate = float(validate_rate(spec.decay_rate))
        memory = self._memory
        job_id = self.job.job_id
        for i in range(self.resumed_at, spec.iterations):
            accessed = await asyncio.to_thread(stream.next_batch, i)
            t0 = time.perf_counter()
            # One call per batch: the router cuts it to the requests the workers take
            # (chunks with ids derived from this one when a hot slot needs them).
            rid = iteration_op_id(job_id, i, "reinforce")
            t.hits += await self._router.reinforce(accessed, boosts, rid)
            t1 = time.perf_counter()
            swept = await memory.sweep(rate, iteration_op_id(job_id, i, "decay"), spec.topk, True)
            t2 = time.perf_counter()
            t.quality, t.topk = swept.quality, (swept.ids, swept.strengths)
            assert t.quality is not None  # asked for
            await self._convergence(accessed, t)
            t3 = time.perf_counter()
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                t.phase_s[phase].append(seconds)
            t.iteration_s.append(t3 - t0)
            t.accesses += len(accessed)
            await self._publish(
                {
                    "phase": "iterate",
                    "iteration": i + 1,
                    "iterations": spec.iterations,
                    "iteration_ms": round((t3 - t0) * 1e3, 3),
                    "memories": t.quality.count,
                    "mean_strength": t.quality.mean,
                    "histogram": [int(c) for c in t.quality.histogram],
                    "convergence": t.convergence,
                    "accessed_mean_strength": t.accessed_mean,
                    "quality": quality_doc(t.quality),
                },
                i + 1 == spec.iterations,
            )
            self._checkpoint(i + 1, force=i + 1 == spec.iterations)
        if t.quality is None:  # resumed after its last iteration: report the store as it is
            t.quality, t.topk = await memory.quality(), await memory.topk(spec.topk)
            if skipped is not None:
                await self._convergence(skipped, t)
        return t

    def _checkpoint(self, iterations: int, force: bool = False) -> None:
        """Save that the load is done and ``iterations`` completed.

        At most every ``CHECKPOINT_INTERVAL_S`` unless ``force``.
        """
        now = time.monotonic()
        if self._state is None or (
            not force and now - self._last_checkpoint < CHECKPOINT_INTERVAL_S
        ):
            return
        self._last_checkpoint = now
        self._state.save_memory_progress(self.job.job_id, True, iterations)

    async def _publish(self, progress: dict[str, Any], force: bool) -> None:
        now = time.monotonic()
        if force or now - self._last_progress >= PROGRESS_INTERVAL_S:
            self._last_progress = now
            await self._jobs.update(self.job, progress=progress)

    def _result(self, memories: int, load_s: float, t: _Timings) -> dict[str, Any]:
        ms = np.asarray(t.iteration_s or [0.0]) * 1e3  # no iteration left after a resume: 0
        q = t.quality
        assert q is not None
        top_ids, top_s = t.topk
        return {
            "iterations": self.resumed_at + len(ms),
            "resumed_at_iteration": self.resumed_at,
            "memories": memories,
            "iteration_ms_p50": float(np.percentile(ms, 50)),
            "iteration_ms_p99": float(np.percentile(ms, 99)),
            "iteration_ms_std": float(np.std(ms)),
            "phase_ms_p50": {
                p: float(np.median(s) * 1e3) if s else 0.0 for p, s in t.phase_s.items()
            },
            "load_s": load_s,
            "upserts_per_s": memories / load_s if load_s > 0 else 0.0,
            "reinforces_per_s": t.accesses / (sum(t.phase_s["reinforce"]) or 1.0),
            "reinforce_hits": t.hits,
            "accesses": t.accesses,
            "convergence": t.convergence,
            "accessed_mean_strength": t.accessed_mean,
            "quality": quality_doc(q),
            "topk_k": self.spec.topk,
            "topk": [
                {"id": int(i), "strength": float(s)}
                for i, s in zip(
                    top_ids[:TOPK_SHOWN].tolist(), top_s[:TOPK_SHOWN].tolist(), strict=True
                )
            ],
        }


def quality_doc(q: Quality) -> dict[str, Any]:
    """A table's strength statistics as the job's documents show them (``quality``).

    count (memories), mean (float64), min and max (float32 values), histogram (10 counts of
    bins of width 0.1 over [0, 1], the last closed).
    """
    return {
        "count": q.count,
        "mean": q.mean,
        "min": q.min,
        "max": q.max,
        "histogram": [int(c) for c in q.histogram],
    }
