"""The ``RunAllreduce`` RPC of the ``neuroshard.v1.Worker`` service (``strategy: allreduce``).

One call is one generation of one job on this worker: it validates the header, gets (or
starts) the job's child process, and relays the child's frames as events. A stop message
from the coordinator is passed on while the generation runs. When the coordinator cancels the
call, or it breaks, the child is killed: nobody would tell it what to do next. Domain errors
map to status codes through one table, ``_ERRORS`` (``shared.rpc.status_table``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc import aio

from shared.config import ConfigError
from shared.proto import worker_pb2
from shared.rpc.status_table import BadRequest, Status, StatusTable
from shared.training.data import DataError
from shared.training.entry_points import EntryPointRefused
from shared.training.models import ModelError
from worker.allreduce.allreduce_sessions import (
    AllreduceChild,
    AllreduceSessions,
    ChildFailed,
    GenerationOrder,
)
from worker.allreduce.child_pipe import Frame
from worker.allreduce.rendezvous_store import MIN_SECRET_HEX
from worker.training.shards import ShardFetchError

__all__ = ["AllreduceServicer"]


class GenerationDropped(Exception):
    """The coordinator ended the call before the rendezvous (CANCELLED).

    The child, and the state it holds, stays for the next generation.
    """


# Domain errors of RunAllreduce and the status each maps to.
_ERRORS = StatusTable(
    [
        (BadRequest, grpc.StatusCode.INVALID_ARGUMENT),
        (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
        (DataError, grpc.StatusCode.INVALID_ARGUMENT),
        (ModelError, grpc.StatusCode.INVALID_ARGUMENT),
        (EntryPointRefused, grpc.StatusCode.PERMISSION_DENIED),
        (ChildFailed, grpc.StatusCode.FAILED_PRECONDITION),
        (GenerationDropped, grpc.StatusCode.CANCELLED),
        # FetchShard's own status (NOT_FOUND, PERMISSION_DENIED, UNAVAILABLE, ...).
        (ShardFetchError, lambda e: Status(e.code)),
    ]
)


class AllreduceServicer:
    """``RunAllreduce``, served through ``WorkerServicer``."""

    def __init__(self, sessions: AllreduceSessions, chunk_bytes: int) -> None:
        """Serve generations of this worker's allreduce jobs.

        Args:
            sessions: the children by job id.
            chunk_bytes: size of one state chunk sent to the coordinator, bytes.
        """
        self._sessions = sessions
        self._chunk_bytes = chunk_bytes

    async def RunAllreduce(
        self,
        request_iterator: AsyncIterator[worker_pb2.AllreduceInput],
        context: aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[worker_pb2.AllreduceEvent]:
        """Run one generation of an allreduce job here and stream what happens.

        Receives an ``AllreduceHeader`` (then state chunks and ``state_done`` when
        ``state_follows``) and answers ``loaded`` once the job's child process is ready;
        then receives the ``rendezvous`` (rank 0's store, or "" on rank 0) and possibly
        ``stop``. Streams rank 0's ``store_port``, ``joined`` once the rank is in the group,
        ``progress`` and ``state`` chunks (rank 0), and last ``ended``. A call dropped
        before its rendezvous leaves the child as it was; one cancelled during the
        generation kills it.

        Raises:
            INVALID_ARGUMENT: no header first, a rank outside [0, world_size), no
                rendezvous_secret (or not hex), a bad spec, or data that cannot be loaded.
            PERMISSION_DENIED: the model's entry is not in this worker's allowed_models.
            FAILED_PRECONDITION: the child process refused the job or died.
            FetchShard's status: a file data set's rows could not be fetched.
        """
        async with _ERRORS.mapped(context):
            header, state = await self._read_header(request_iterator)
            child = await self._sessions.child(header.job_id, header.spec_json)
            yield worker_pb2.AllreduceEvent(loaded=True)
            master = await self._read_rendezvous(request_iterator, header)
            order = GenerationOrder(
                header.generation,
                header.rank,
                header.world_size,
                master,
                max(header.checkpoint_every_steps, 1),
                header.timeout_s if header.timeout_s > 0 else 60.0,
                header.rendezvous_secret,
                int(header.stop_at_step),
                header.window_rows,
                header.window_weights,
                int(header.window_first_step),
                header.send_start_state,
            )
            stops = asyncio.create_task(_forward_stops(request_iterator, child))
            ended = False
            try:
                async with child.lock:
                    async for frame in child.generation(order, state):
                        for event in self._events(frame):
                            yield event
                        ended = frame.type == "ended"
            finally:
                stops.cancel()
                if not ended:  # cancelled or broken mid-generation: the child is orphaned
                    self._sessions.stop(header.job_id)

    async def _read_rendezvous(
        self,
        requests: AsyncIterator[worker_pb2.AllreduceInput],
        header: worker_pb2.AllreduceHeader,
    ) -> str:
        """Wait for the rendezvous: rank 0's store ``host:port`` ("" on rank 0).

        Raises:
            GenerationDropped: the stream ended, or went on, without one (CANCELLED).
            BadRequest: an address on rank 0, or none on another rank (INVALID_ARGUMENT).
        """
        msg = await anext(requests, None)
        if msg is None or not msg.HasField("rendezvous"):
            # The coordinator gave up on this generation before it began: the child (and
            # the state it holds) stays for the next one.
            raise GenerationDropped("no rendezvous: generation dropped")
        if bool(msg.rendezvous) != (header.rank > 0):
            raise BadRequest(
                f"rendezvous: rank {header.rank} got {msg.rendezvous!r} (rank 0 gets '', "
                "the others rank 0's host:port)"
            )
        return msg.rendezvous

    def stop(self, job_id: str) -> None:
        """Kill a job's child, if this worker has one (the job ended)."""
        self._sessions.stop(job_id)

    async def _read_header(
        self, requests: AsyncIterator[worker_pb2.AllreduceInput]
    ) -> tuple[worker_pb2.AllreduceHeader, bytes]:
        """The header, and the state that follows it (b"" when none does).

        Raises:
            BadRequest: no header first, a rank outside [0, world_size), a malformed
                rendezvous_secret, window_rows not whole int64s or window_weights not one
                float32 each, or something else than state chunks after a header with
                ``state_follows`` (INVALID_ARGUMENT).
        """
        first = await anext(requests, None)
        if first is None or not first.HasField("header"):
            raise BadRequest("the first message must be a header")
        header = first.header
        if header.world_size < 1 or header.rank >= header.world_size:
            raise BadRequest(f"rank {header.rank} is not below world_size {header.world_size}")
        if not _is_secret(header.rendezvous_secret):
            raise BadRequest(
                f"rendezvous_secret: expected at least {MIN_SECRET_HEX} hex digits (an even "
                f"number), got {len(header.rendezvous_secret)} characters"
            )
        rows, weights = len(header.window_rows), len(header.window_weights)
        if rows % 8 or weights * 2 != rows:
            raise BadRequest(
                f"window_rows, window_weights: {rows} and {weights} bytes are not K int64 "
                "rows and K float32 weights"
            )
        chunks: list[bytes] = []
        if header.state_follows:
            async for msg in requests:
                if msg.HasField("state_done"):
                    break
                if not msg.HasField("state"):
                    raise BadRequest("expected state chunks after the header")
                chunks.append(msg.state)
        return header, b"".join(chunks)

    def _events(self, frame: Frame) -> list[worker_pb2.AllreduceEvent]:
        f = frame.fields
        if frame.type == "ready":
            return [worker_pb2.AllreduceEvent(store_port=int(f["port"]))]
        if frame.type == "joined":
            return [worker_pb2.AllreduceEvent(joined=True)]
        if frame.type == "progress":
            return [worker_pb2.AllreduceEvent(progress=worker_pb2.AllreduceProgress(**f))]
        if frame.type == "state":
            data, size = frame.payload, self._chunk_bytes
            starts = range(0, max(len(data), 1), size)
            return [
                worker_pb2.AllreduceEvent(
                    state=worker_pb2.AllreduceState(
                        step=int(f["step"]),
                        reason=str(f["reason"]),
                        data=data[i : i + size],
                        last=i + size >= len(data),
                    )
                )
                for i in starts
            ]
        if frame.type == "ended":
            ended = worker_pb2.AllreduceEnded(**f, losses=frame.payload)
            return [worker_pb2.AllreduceEvent(ended=ended)]
        return []


def _is_secret(secret: str) -> bool:
    """Whether ``secret`` is an even number (>= MIN_SECRET_HEX) of hex digits."""
    if len(secret) < MIN_SECRET_HEX or len(secret) % 2:
        return False
    try:
        bytes.fromhex(secret)
    except ValueError:
        return False
    return True


async def _forward_stops(
    requests: AsyncIterator[worker_pb2.AllreduceInput], child: AllreduceChild
) -> None:
    """Pass the coordinator's ``stop`` to the child until the call ends."""
    with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
        async for msg in requests:
            if msg.HasField("stop"):
                await child.request_stop()
