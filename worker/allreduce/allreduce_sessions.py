"""The ``allreduce`` jobs this worker takes part in: one child process per job.

The child (``worker.allreduce.allreduce_child``) holds the job's replica across generations; this
module starts it, hands it the training rows (a file data set is fetched from the
coordinator once, whole, and written to a private temporary ``.npz`` that is removed once
the child has loaded it), relays one
generation at a time, and kills it when the job ends, the coordinator goes away, or it stops
answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.config import ConfigError, FileData, TrainJobSpec, job_spec_from_json
from shared.logging import get_logger
from shared.training.data import DataError
from shared.training.models import check_model_entry
from worker.allreduce.child_pipe import MAX_LINE_BYTES, AsyncPipe, Frame, PipeClosed
from worker.training.shards import ShardFetcher

log = get_logger(__name__)

# The training child's module, run with ``python -m`` (tests find its processes by it).
CHILD_MODULE = "worker.allreduce.allreduce_child"


class ChildFailed(RuntimeError):
    """The job's child process refused the job or died (the message says which)."""


@dataclass(frozen=True)
class GenerationOrder:
    """What the coordinator asks of this worker for one generation.

    Attributes:
        generation: the generation number, from 0.
        rank: this worker's rank in [0, world_size).
        world_size: W.
        master_addr: rank 0's store as ``host:port`` (empty on rank 0, which makes it).
        checkpoint_every: steps between the checkpoints rank 0 sends.
        timeout_s: deadline of the rendezvous and of each collective, seconds.
        secret: the generation's rendezvous secret, hex (``worker.allreduce.rendezvous_store``).
        stop_at_step: > 0: end the generation at this step (a paced job); 0: at the job's end.
        window_rows: prioritized sampling: the window's drawn rows, int64 little-endian bytes
            (b"": uniform sampling).
        window_weights: their importance weights, float32 little-endian bytes.
        window_first_step: the window's first global step.
        send_start_state: rank 0 sends its full state before its first step.
    """

    generation: int
    rank: int
    world_size: int
    master_addr: str
    checkpoint_every: int
    timeout_s: float
    secret: str
    stop_at_step: int = 0
    window_rows: bytes = b""
    window_weights: bytes = b""
    window_first_step: int = 0
    send_start_state: bool = False


class AllreduceChild:
    """One job's child process and the pipe to it."""

    def __init__(self, job_id: str, proc: asyncio.subprocess.Process) -> None:
        """Wrap a started child; use :meth:`start`."""
        self.job_id, self._proc = job_id, proc
        assert proc.stdout is not None and proc.stdin is not None
        self.pipe = AsyncPipe(proc.stdout, proc.stdin)
        self.total_steps = 0
        self.lock = asyncio.Lock()  # one generation at a time

    @classmethod
    async def start(
        cls, job_id: str, init: dict[str, object], env: dict[str, str]
    ) -> AllreduceChild:
        """Start the child and send it ``init``; return once it has built its replica.

        Raises:
            ChildFailed: it refused the job (its reason) or exited.
        """
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            CHILD_MODULE,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=env,
            limit=MAX_LINE_BYTES,
        )
        child = cls(job_id, proc)
        try:
            await child.pipe.write(Frame("init", dict(init)))
            first = await child.pipe.read()
        except PipeClosed:
            child.kill()
            raise ChildFailed(f"the training process of job {job_id} exited at start") from None
        if first.type != "loaded":
            child.kill()
            raise ChildFailed(str(first.fields.get("message", first.type)))
        child.total_steps = int(first.fields["total_steps"])
        return child

    @property
    def alive(self) -> bool:
        """True while the process runs."""
        return self._proc.returncode is None

    async def generation(self, order: GenerationOrder, state: bytes) -> AsyncIterator[Frame]:
        """Run one generation; yield the child's frames up to and including ``ended``.

        Raises:
            ChildFailed: the child died during the generation.
        """
        host, _, port = order.master_addr.rpartition(":")
        fields = {
            "generation": order.generation,
            "rank": order.rank,
            "world_size": order.world_size,
            "master_addr": host.strip("[]"),
            "master_port": int(port or 0),
            "checkpoint_every": order.checkpoint_every,
            "timeout_s": order.timeout_s,
            "secret": order.secret,
            "stop_at": order.stop_at_step,
            "windowed": bool(order.window_rows),
            "send_start_state": order.send_start_state,
        }
        try:
            if order.window_rows:  # the child keeps it for the generation that follows
                window = {
                    "first_step": order.window_first_step,
                    "rows_bytes": len(order.window_rows),
                }
                await self.pipe.write(
                    Frame("window", window, order.window_rows + order.window_weights)
                )
            await self.pipe.write(Frame("generation", fields, state))
            while True:
                frame = await self.pipe.read()
                yield frame
                if frame.type == "ended":
                    return
        except PipeClosed:
            self.kill()
            raise ChildFailed(
                f"the training process of job {self.job_id} died (exit code "
                f"{self._proc.returncode})"
            ) from None

    async def request_stop(self) -> None:
        """Ask the child to end its generation at the next control point."""
        with contextlib.suppress(PipeClosed):
            await self.pipe.write(Frame("stop"))

    def kill(self) -> None:
        """Kill the process (idempotent)."""
        if self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()

    async def wait(self) -> None:
        """Wait for the process to exit."""
        await self._proc.wait()


class AllreduceSessions:
    """This worker's allreduce children by job id."""

    def __init__(
        self,
        torch_threads: int,
        allowed_models: Mapping[str, str],
        name: str,
        fetcher: ShardFetcher | None,
        advertise_host: str,
        allowed_losses: Mapping[str, str] | None = None,
    ) -> None:
        """No child yet.

        Args:
            torch_threads: ``torch.set_num_threads`` of each child.
            allowed_models: the model entry points a job may name.
            name: this worker's name, for messages.
            fetcher: gets a file data set's rows from the coordinator (None: refused).
            advertise_host: the host other workers reach this one at: rank 0's store and
                every rank's gloo listen there only.
            allowed_losses: the loss entry points a job may name.
        """
        self._torch_threads = torch_threads
        self._allowed_models = dict(allowed_models)
        self._allowed_losses = dict(allowed_losses or {})
        self._daemon = f"worker {name}".strip()
        self._fetcher = fetcher
        self._advertise_host = advertise_host
        self._children: dict[str, AllreduceChild] = {}
        self._starting: dict[str, asyncio.Lock] = {}
        self._exiting: set[asyncio.Task[None]] = set()  # killed children not yet reaped

    async def child(self, job_id: str, spec_json: str) -> AllreduceChild:
        """The job's child, started (with its data) on first use.

        Raises:
            ConfigError: the spec is invalid or not a train spec (INVALID_ARGUMENT).
            EntryPointRefused: its model's entry is not listed here (PERMISSION_DENIED).
            ModelError: its model's args do not fit the entry (INVALID_ARGUMENT).
            DataError, ShardFetchError: its data cannot be had (INVALID_ARGUMENT, or
                FetchShard's status).
            ChildFailed: the child refused the job (FAILED_PRECONDITION).
        """
        lock = self._starting.setdefault(job_id, asyncio.Lock())
        async with lock:
            existing = self._children.get(job_id)
            if existing is not None and existing.alive:
                return existing
            spec = job_spec_from_json(spec_json)
            if not isinstance(spec, TrainJobSpec):
                raise ConfigError(f"kind: expected 'train', got {spec.kind!r}")
            check_model_entry(spec, self._allowed_models, self._daemon, self._allowed_losses)
            tmp = Path(tempfile.mkdtemp(prefix=f"neuroshard-{job_id[:16]}-"))
            try:
                init = await self._init(job_id, spec, spec_json, tmp)
                child = await AllreduceChild.start(job_id, init, dict(os.environ))
            finally:  # the child has loaded its rows (or failed): the file has served
                shutil.rmtree(tmp, ignore_errors=True)
            self._children[job_id] = child
            log.info("allreduce_child_started", job_id=job_id, steps=child.total_steps)
            return child

    async def _init(
        self, job_id: str, spec: TrainJobSpec, spec_json: str, tmp: Path
    ) -> dict[str, object]:
        data_path, num_classes = "", 0
        if isinstance(spec.data, FileData):
            if self._fetcher is None:
                raise DataError("data.path: this worker has no coordinator to fetch rows from")
            data, rows = await self._fetcher.fetch(job_id, (0, 1))
            data_path, num_classes = str(tmp / "train.npz"), data.num_classes
            await asyncio.to_thread(np.savez, data_path, x=rows.x, y=rows.y)
        return {
            "spec_json": spec_json,
            "data_path": data_path,
            "num_classes": num_classes,
            "torch_threads": self._torch_threads,
            "allowed_models": self._allowed_models,
            "allowed_losses": self._allowed_losses,
            "daemon": self._daemon,
            "bind_host": self._advertise_host,
        }

    def stop(self, job_id: str) -> None:
        """Kill a job's child (idempotent)."""
        child = self._children.pop(job_id, None)
        self._starting.pop(job_id, None)
        if child is not None:
            child.kill()
            reap = asyncio.ensure_future(child.wait())
            self._exiting.add(reap)
            reap.add_done_callback(self._exiting.discard)
            log.info("allreduce_child_stopped", job_id=job_id)

    async def close(self) -> None:
        """Kill every child and wait for them to exit."""
        for job_id in list(self._children):
            self.stop(job_id)
        await asyncio.gather(*self._exiting, return_exceptions=True)
