"""``DistributedLearner``: one long-lived train job driven an epoch at a time.

```python
learner = DistributedLearner("host:50051", num_nodes=5, memory_capacity=10_000_000,
                             decay_rate=0.01, model="mlp", data="digits")
for _ in range(10):
    q = learner.run_epoch()   # one epoch of training (decay + reinforce + aggregate)
    print(q["epoch"], q["convergence"], q["loss"], q["quality"])
learner.close()               # the job ends SUCCEEDED, its model saved
```

Behind it is one paced train job (spec ``paced: true``, ``coordinator.jobs.pacing``): the
model, the optimizer state and the priorities persist between ``run_epoch`` calls, which
grant one epoch each (``RunEpochs``); ``close`` asks the job to finish (``FinishJob``); a
coordinator restart resumes it from its checkpoint at the epoch boundary. The figures are
those the coordinator adds to each epoch's history entry
(``coordinator.training.epoch_figures``): ``convergence`` = L_0 / L_e.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from typing import Any

import grpc

from shared.client.async_client import Client, JobInfo, NeuroshardError
from shared.security.transport import ChannelSecurity

STRATEGIES = ("sync", "allreduce", "diloco")
# The keys of run_epoch's result taken from the epoch's history entry as they are.
_ENTRY_KEYS = (
    "initial_loss",
    "convergence",
    "test_loss",
    "test_accuracy",
    "iteration_ms_p50",
    "iteration_ms_std",
    "wire_bytes",
    "wire_mbit_s",
    "failures",
)


def _refused(message: str) -> NeuroshardError:
    return NeuroshardError(message, grpc.StatusCode.INVALID_ARGUMENT)


def priority_table(job_id: str) -> str:
    """The replay table a prioritized train job keeps its rows' priorities in."""
    return f"job-{job_id}-priorities"


class DistributedLearner:
    """A paced train job on a neuroshard cluster, one ``run_epoch`` per epoch.

    It runs its own event loop, so it cannot be used from inside a running loop (as
    ``SyncClient``). Use it as a context manager, or call ``close``.

    Attributes:
        job_id: the job behind the learner.
        train_rows: the data set's training rows N, as the coordinator loaded them.
        epochs_run: epochs run so far.
        final: the job's final state once closed (None before).
    """

    def __init__(
        self,
        address: str,
        num_nodes: int,
        memory_capacity: int,
        decay_rate: float,
        gpu_enabled: bool = False,
        model: str | dict[str, Any] = "mlp",
        data: str | dict[str, Any] = "digits",
        task: str = "classification",
        strategy: str = "sync",
        sampling: str | dict[str, Any] | None = None,
        max_epochs: int = 100,
        spec: dict[str, Any] | None = None,
        security: ChannelSecurity | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        """Reach the coordinator, submit the paced job and wait until it is ready to train.

        Args:
            address: the coordinator's ``host:port``.
            num_nodes: workers the job trains on (the spec's ``workers``), >= 1.
            memory_capacity: memories the learner may keep, >= the data set's training rows
                N: a prioritized job keeps one memory (priority) per training row, so a
                smaller capacity could not hold them; checked once the coordinator has
                loaded the data (the job is cancelled when it is too small).
            decay_rate: the priorities' decay per epoch, in [0, 1]; with ``sampling`` it is
                the block's ``decay_rate``; without (uniform sampling keeps no priorities) it
                is checked and has no effect.
            gpu_enabled: train on CUDA (``device: cuda``): every worker taking part must
                train on CUDA; False trains on CPU.
            model: the spec's ``model`` (``mlp``, ``cnn``, ``{entry: NAME, args: {...}}``).
            data: the spec's ``data`` (``digits``, ``{path: F.npz}``).
            task: ``classification``, ``regression`` or ``language_model``.
            strategy: ``sync``, ``allreduce`` or ``diloco``.
            sampling: the spec's ``sampling`` block (``prioritized``, or a dict with its
                keys: ``alpha``, ``beta``, ...), passed through with ``decay_rate`` set; None:
                uniform sampling.
            max_epochs: the most epochs ``run_epoch`` may run (the spec's ``epochs``, also
                the horizon of a decaying lr schedule).
            spec: more spec keys (``batch_size``, ``optimizer``, ``seed``, ...); they win
                over the arguments above.
            security: TLS files and token (``shared.security.transport.client_security``).
            timeout_s: how long to try to reach the coordinator, and each call's deadline,
                seconds.

        Raises:
            NeuroshardError: INVALID_ARGUMENT naming the argument or spec field refused
                (here or by the coordinator); UNAVAILABLE when the coordinator at
                ``address`` cannot be reached within ``timeout_s``; FAILED_PRECONDITION
                for ``gpu_enabled`` without enough CUDA workers, or a job that ended
                before its first epoch (its error).
        """
        job_spec = _learner_spec(
            num_nodes, memory_capacity, decay_rate, gpu_enabled, model, data, task, strategy,
            sampling, max_epochs, spec,
        )  # fmt: skip
        self.address, self.timeout_s = address, timeout_s
        self.memory_capacity = memory_capacity
        self._sampling = job_spec.get("sampling")
        self.epochs_run = 0
        self.final: JobInfo | None = None
        self._runner = asyncio.Runner()
        self._client = self._runner.run(_make_client(address, timeout_s, security))
        try:
            self._runner.run(self._reach(gpu_enabled, num_nodes))
            self.job_id = self._runner.run(self._client.submit(job_spec)).job_id
            self.train_rows = self._runner.run(self._ready())
        except BaseException:
            self._shut()
            raise

    # -- the epochs ---------------------------------------------------------------------

    def run_epoch(self) -> dict[str, Any]:
        """Grant the job one epoch and wait until it has run; return its figures.

        Returns:
            ``epoch`` (from 0), ``convergence`` (L_0 / L_e), ``loss`` (L_e, the epoch's
            mean per-sample training loss), ``initial_loss`` (L_0), ``test_loss``,
            ``test_accuracy``, ``quality`` (the priority table's ``count``, ``mean``,
            ``min``, ``max``, ``histogram`` of 10 bins over [0, 1]; None without a
            priority table), ``iteration_ms_p50`` and ``iteration_ms_std`` (the epoch's
            steps, ms), ``wire_bytes`` and ``wire_mbit_s`` (the job's step messages through
            the coordinator) and ``failures`` (workers lost during the epoch).

        Raises:
            NeuroshardError: FAILED_PRECONDITION when the job has ended (its error) or its
                ``max_epochs`` have run; UNAVAILABLE when the coordinator is unreachable.
        """
        if self.final is not None:
            raise NeuroshardError(
                f"the learner of job {self.job_id} is closed", grpc.StatusCode.FAILED_PRECONDITION
            )
        return self._runner.run(self._run_epoch())

    async def _run_epoch(self) -> dict[str, Any]:
        granted = await self._client.run_epochs(self.job_id, 1)
        entry = await self._epoch_entry(granted)
        self.epochs_run = granted
        out: dict[str, Any] = {"epoch": granted - 1, "loss": entry["train_loss"]}
        out |= {k: entry.get(k, math.nan) for k in _ENTRY_KEYS}
        out["quality"] = await self._quality()
        return out

    async def _epoch_entry(self, epoch: int) -> dict[str, Any]:
        """The history entry of epoch ``epoch`` (from 1), once the job has run it."""
        async with contextlib.aclosing(self._client.watch(self.job_id)) as events:
            async for job, progress in events:
                found = _entry(progress.get("history", []), epoch)
                if found is None and job.terminal:
                    found = _entry((job.result or {}).get("history", []), epoch)
                    if found is None:
                        raise NeuroshardError(
                            f"job {self.job_id} is {job.state} before epoch {epoch - 1} "
                            f"ended: {job.error}",
                            grpc.StatusCode.FAILED_PRECONDITION,
                        )
                if found is not None:
                    return found
        raise NeuroshardError(
            f"the events of job {self.job_id} ended early", grpc.StatusCode.UNAVAILABLE
        )

    async def _quality(self) -> dict[str, Any] | None:
        """The priority table's strength statistics; None without a priority table."""
        if not self._sampling or self._sampling.get("name", "uniform") == "uniform":
            return None
        try:
            q = await self._client.quality(priority_table(self.job_id))
        except NeuroshardError as exc:
            if exc.code is grpc.StatusCode.NOT_FOUND:
                return None
            raise
        return {k: q[k] for k in ("count", "mean", "min", "max", "histogram")}

    # -- start and end ------------------------------------------------------------------

    async def _reach(self, gpu_enabled: bool, num_nodes: int) -> None:
        """Ask the cluster's status until it answers; check the GPUs asked for.

        Raises:
            NeuroshardError: UNAVAILABLE after ``timeout_s``, naming the address;
                FAILED_PRECONDITION for ``gpu_enabled`` without ``num_nodes`` CUDA workers.
        """
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                status = await self._client.status()
                break
            except NeuroshardError as exc:
                if exc.code not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ):
                    raise
                if time.monotonic() >= deadline:
                    raise NeuroshardError(
                        f"cannot reach the coordinator at {self.address} within "
                        f"{self.timeout_s:g} s (timeout_s): {exc}",
                        grpc.StatusCode.UNAVAILABLE,
                    ) from None
                await asyncio.sleep(0.2)
        if gpu_enabled:
            alive = [w for w in status["workers"] if w["state"] == "ALIVE"]
            cuda = [w for w in alive if str(w["train_device"]).startswith("cuda")]
            if len(cuda) < num_nodes:
                devices = ", ".join(f"{w['name']} {w['train_device']}" for w in alive) or "none"
                raise NeuroshardError(
                    f"gpu_enabled: True needs {num_nodes} workers training on CUDA "
                    f"(num_nodes), but {len(cuda)} of the {len(alive)} ALIVE workers at "
                    f"{self.address} do (workers: {devices}); pass gpu_enabled=False to "
                    "train on CPU",
                    grpc.StatusCode.FAILED_PRECONDITION,
                )

    async def _ready(self) -> int:
        """Wait until the job waits for its first epoch; check memory_capacity; return N.

        Raises:
            NeuroshardError: FAILED_PRECONDITION when the job ended first (its error);
                INVALID_ARGUMENT when memory_capacity < N (the job is cancelled).
        """
        async with contextlib.aclosing(self._client.watch(self.job_id)) as events:
            async for job, progress in events:
                if job.terminal:
                    raise NeuroshardError(
                        f"job {self.job_id} is {job.state} before its first epoch: {job.error}",
                        grpc.StatusCode.FAILED_PRECONDITION,
                    )
                if "train_rows" in progress:
                    rows = int(progress["train_rows"])
                    break
            else:
                raise NeuroshardError(
                    f"the events of job {self.job_id} ended early", grpc.StatusCode.UNAVAILABLE
                )
        if self.memory_capacity < rows:
            await self._client.cancel(self.job_id)
            raise _refused(
                f"memory_capacity: {self.memory_capacity} is less than the data set's {rows} "
                "training rows; the learner keeps one memory (priority) per training row"
            )
        return rows

    def close(self) -> JobInfo | None:
        """Finish the job (it ends SUCCEEDED, its model saved) and close the channels.

        Returns:
            The job's final state (None when it was closed already).

        Raises:
            NeuroshardError: the coordinator could not be reached (the channels are closed
                all the same).
        """
        if self.final is not None or not hasattr(self, "job_id"):
            return None
        try:
            self.final = self._runner.run(self._finish())
        finally:
            self._shut()
        return self.final

    async def _finish(self) -> JobInfo:
        job = await self._client.get_job(self.job_id)
        if not job.terminal:
            await self._client.finish(self.job_id)
            job = await self._client.wait(self.job_id)
        return job

    def _shut(self) -> None:
        with contextlib.suppress(Exception):
            self._runner.run(self._client.close())
        self._runner.close()

    def __enter__(self) -> DistributedLearner:
        """Return the learner; leaving the block closes it."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the learner (``close``)."""
        self.close()


async def _make_client(address: str, timeout_s: float, security: ChannelSecurity | None) -> Client:
    """Make the client inside the runner's loop (grpc.aio channels bind to it)."""
    return Client(address, timeout_s, security=security)


def _entry(history: list[dict[str, Any]], epoch: int) -> dict[str, Any] | None:
    return next((h for h in history if h.get("epoch") == epoch), None)


def _learner_spec(
    num_nodes: int,
    memory_capacity: int,
    decay_rate: float,
    gpu_enabled: bool,
    model: str | dict[str, Any],
    data: str | dict[str, Any],
    task: str,
    strategy: str,
    sampling: str | dict[str, Any] | None,
    max_epochs: int,
    spec: dict[str, Any] | None,
) -> dict[str, Any]:
    """The paced job's spec from the learner's arguments.

    Raises:
        NeuroshardError: INVALID_ARGUMENT naming the argument.
    """
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise _refused(f"num_nodes: must be an integer >= 1, got {num_nodes!r}")
    if not isinstance(memory_capacity, int) or memory_capacity < 1:
        raise _refused(f"memory_capacity: must be an integer >= 1, got {memory_capacity!r}")
    if not (isinstance(decay_rate, int | float) and 0.0 <= decay_rate <= 1.0):
        raise _refused(f"decay_rate: must be in [0, 1], got {decay_rate!r}")
    if strategy not in STRATEGIES:
        raise _refused(f"strategy: must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    out: dict[str, Any] = {
        "kind": "train",
        "name": "learner",
        "workers": num_nodes,
        "model": model,
        "data": data,
        "task": task,
        "strategy": strategy,
        "device": "cuda" if gpu_enabled else "cpu",
        "epochs": max_epochs,
    }
    if isinstance(sampling, str):  # the spec's short form
        sampling = {"name": sampling}
    if sampling is not None:
        given = sampling.get("decay_rate")
        if given is not None and given != decay_rate:
            raise _refused(
                f"sampling.decay_rate: {given!r} differs from decay_rate {decay_rate!r}; give one"
            )
        out["sampling"] = {**sampling, "decay_rate": decay_rate}
    return out | (spec or {}) | {"paced": True}
