"""Stream the whole memory store out, slot batch by slot batch (``ExportMemories``).

The coordinator reads each batch of consecutive slots (about ``batch_memories`` memories,
and at most ``batch_bytes`` of them: a read past that is dropped and done again in fewer
slots)
from the slots' primaries with the workers' ``DumpSlots`` (one call per primary,
concurrently) while it holds the rebalancer's ``map_lock``, so no map is published
meanwhile and each slot is read from the worker that is its primary, after any copy that
made it so. The batch is then cut into ``MemoryChunk``
messages of about ``chunk_bytes`` (payloads counted) and sent with the lock released: a slow
client never holds up a rebalance. At most one batch is held here at a time.

Consistency: a primary reads all the slots of one ``DumpSlots`` call in one job of its store
thread, between two operations, so each slot (and each batch of one primary) is a
point-in-time copy holding every write that primary had applied when it was read. Batches
are read at different instants: a write that runs during the export may or may not be in
it, and a batch written across slots may be in it for some of its slots only. The export is
exactly the store when nothing writes to it meanwhile.

Shape letters: n memories of a batch.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
from grpc import aio

from coordinator.placement.membership import Membership, WorkerState
from coordinator.placement.rebalance import Rebalancer
from shared.proto import coordinator_pb2, worker_pb2
from shared.rpc.chunking import byte_ranges, memory_sizes
from shared.rpc.codec import CodecError, f32_from_bytes, f32_to_bytes, ids_from_bytes, ids_to_bytes
from shared.rpc.peers import WorkerClients

# Memories read per hold of map_lock (~6 MB here, and what the primaries copy out at once):
# fewer, larger batches cost fewer round trips; smaller ones hold up a rebalance less. The
# default of ``export_batch_memories``.
BATCH_MEMORIES = 500_000
BATCH_BYTES = 64 << 20  # the default of ``export_batch_bytes``


class _BatchTooLarge(Exception):
    """A batch's dumps passed the byte budget while being read (read it again, smaller)."""


class ExportsBusy(Exception):
    """``max_concurrent_exports`` exports are running already (RESOURCE_EXHAUSTED)."""


class ExportUnavailable(RuntimeError):
    """A slot has no live primary, or a primary failed, past the retry budget (UNAVAILABLE).

    Attributes:
        retryable: False when a slot's every holder is dead (its data waits for one of them
            to come back, or for ``forget-worker``): retrying within seconds cannot help.
    """

    def __init__(self, message: str, retryable: bool = True) -> None:
        """Carry ``message`` and whether a retry may succeed."""
        super().__init__(message)
        self.retryable = retryable


@dataclass
class Batch:
    """Memories of consecutive slots, in slot order.

    Attributes:
        ids: [n] uint64.
        strengths: [n] float32.
        payloads: id -> payload for the ids that have one.
    """

    ids: np.ndarray
    strengths: np.ndarray
    payloads: dict[int, bytes] = field(default_factory=dict)


def cut_chunks(
    batch: Batch, chunk_bytes: int, slots_done: int
) -> list[coordinator_pb2.MemoryChunk]:
    """Cut a batch into messages of about ``chunk_bytes`` each, payloads counted.

    A message holds at least one memory, so one payload larger than ``chunk_bytes`` (at most
    ``max_payload_bytes``, 16 MiB) travels alone. A batch without memories is one empty
    message (it carries the progress).

    Args:
        batch: the memories.
        chunk_bytes: target message size, bytes.
        slots_done: slots completely sent once the last message of the batch is.
    """
    pairs = byte_ranges(memory_sizes(batch.ids, batch.payloads), chunk_bytes) or [(0, 0)]
    out = []
    for a, b in pairs:
        ids = batch.ids[a:b]
        pids = [i for i in ids.tolist() if i in batch.payloads] if batch.payloads else []
        out.append(
            coordinator_pb2.MemoryChunk(
                ids=ids_to_bytes(ids),
                strengths=f32_to_bytes(batch.strengths[a:b]),
                payload_ids=pids,
                payloads=[batch.payloads[i] for i in pids],
                slots_done=slots_done,
            )
        )
    return out


class StoreExport:
    """Reads the store from the primaries of the current map (module docstring)."""

    def __init__(
        self,
        rebalancer: Rebalancer,
        membership: Membership,
        clients: WorkerClients,
        rpc_timeout_s: float,
        chunk_bytes: int,
        retry_budget_s: float = 10.0,
        batch_memories: int = BATCH_MEMORIES,
        batch_bytes: int = BATCH_BYTES,
        table: str = "",
    ) -> None:
        """Export one table through ``rebalancer``'s map.

        Args:
            rebalancer: owner of the slot map and its ``map_lock``.
            membership: the workers' states and addresses.
            clients: channels to the workers.
            rpc_timeout_s: deadline of each ``DumpSlots`` call, seconds.
            chunk_bytes: target size of one ``MemoryChunk``, bytes.
            retry_budget_s: how long a batch is retried while a slot has no live primary or
                a primary fails (a failover in progress), seconds.
            batch_memories: about how many memories a batch reads (``export_batch_memories``;
                by the heartbeats' counts: slots per batch = slots * batch_memories /
                memories, at least 1).
            batch_bytes: most bytes of ``SlotData`` a batch may hold (``export_batch_bytes``):
                a read that passes it is dropped and done again in half the slots, and later
                batches take as many slots as the bytes per memory seen so far allow. A
                single slot is read whole.
            table: the table exported, as on the wire ("": the default one).
        """
        self._rebalancer = rebalancer
        self._membership = membership
        self._clients = clients
        self._timeout_s = rpc_timeout_s
        self._chunk_bytes = chunk_bytes
        self._retry_budget_s = retry_budget_s
        self._batch_memories = batch_memories
        self._batch_bytes = batch_bytes
        self._table = table

    async def chunks(self) -> AsyncIterator[coordinator_pb2.ExportChunk]:
        """Yield the header, then the memories of every slot in slot order.

        Raises:
            ExportUnavailable: a batch could not be read within the retry budget
                (UNAVAILABLE); the message names the slot or the worker.
        """
        current = self._rebalancer.current
        if current.epoch == 0:
            raise ExportUnavailable("the cluster has no slot map yet (no worker has joined)")
        memories = sum(w.memories for w in self._membership.alive())
        yield coordinator_pb2.ExportChunk(
            header=coordinator_pb2.ExportHeader(
                slots=current.slots, slot_map_epoch=current.epoch, memories=memories
            )
        )
        per = max(1, min(current.slots, current.slots * self._batch_memories // max(memories, 1)))
        start = 0
        while start < current.slots:
            slots = list(range(start, min(start + per, current.slots)))
            try:
                batch = await self._read_retrying(slots)
            except _BatchTooLarge:
                per = max(1, len(slots) // 2)
                continue
            start = slots[-1] + 1
            per = self._next_per(per, batch, len(slots))
            for chunk in cut_chunks(batch, self._chunk_bytes, start):
                yield coordinator_pb2.ExportChunk(memories=chunk)
            del batch

    def _next_per(self, per: int, batch: Batch, slots: int) -> int:
        """Slots of the next batch: at most ``per``, and what ``batch_bytes`` holds.

        At the bytes per slot of the batch just read, so payload-heavy stores read fewer
        slots at once.
        """
        nbytes = int(memory_sizes(batch.ids, batch.payloads).sum())
        if nbytes == 0:
            return per
        return max(1, min(per, self._batch_bytes * slots // nbytes))

    async def _read_retrying(self, slots: list[int]) -> Batch:
        """``_read`` with jittered backoff (50 ms doubling to 1 s) for ``retry_budget_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._retry_budget_s
        backoff_s = 0.05
        while True:
            try:
                return await self._read(slots)
            except ExportUnavailable as exc:
                pause_s = backoff_s * random.uniform(0.5, 1.0)
                if not exc.retryable or loop.time() + pause_s > deadline:
                    raise
            await asyncio.sleep(pause_s)
            backoff_s = min(2 * backoff_s, 1.0)

    async def _read(self, slots: list[int]) -> Batch:
        """Read ``slots`` from their primaries under ``map_lock``; memories in slot order.

        Raises:
            ExportUnavailable: a slot without a live primary, or a primary that failed or
                did not send every slot asked for.
        """
        async with self._rebalancer.map_lock:
            current = self._rebalancer.current
            by_primary: dict[str, list[int]] = {}
            for s in slots:
                name = current.primary[s]
                if not self._alive(name):
                    self._no_primary(s, name, current.replica[s])
                by_primary.setdefault(name, []).append(s)
            budget = [self._batch_bytes if len(slots) > 1 else None]
            replies = await asyncio.gather(
                *(self._dump(n, sl, budget) for n, sl in by_primary.items()),
                return_exceptions=True,
            )
        parts: dict[int, Batch] = {}
        for name, r in zip(by_primary, replies, strict=True):
            if isinstance(r, _BatchTooLarge):
                raise r
            if isinstance(r, BaseException):
                detail = r.details() if isinstance(r, aio.AioRpcError) else str(r)
                raise ExportUnavailable(f"primary {name} failed to send its slots: {detail}")
            parts |= r
        ordered = [parts[s] for s in slots]
        merged = Batch(
            np.concatenate([b.ids for b in ordered]),
            np.concatenate([b.strengths for b in ordered]),
        )
        for b in ordered:
            merged.payloads |= b.payloads
        return merged

    def _alive(self, name: str) -> bool:
        """Whether ``name`` is a known worker that is not DEAD."""
        rec = self._membership.get(name) if name else None
        return rec is not None and rec.state is not WorkerState.DEAD

    def _no_primary(self, s: int, primary: str, replica: str) -> None:
        """Raise why slot ``s`` cannot be read now.

        No primary at all is a moment of a rebalance (a slot re-created empty, a fence); a
        dead primary with a live replica, a failover in progress: both retryable. A dead
        primary without a live replica is a slot whose data waits for a dead worker.

        Raises:
            ExportUnavailable: always.
        """
        if not primary:
            raise ExportUnavailable(f"slot {s} has no primary yet (a rebalance is under way)")
        if self._alive(replica):
            raise ExportUnavailable(f"slot {s}: its primary {primary} is dead (failover under way)")
        dead = ", ".join(h for h in (primary, replica) if h)
        raise ExportUnavailable(
            f"slot {s} has no live copy: its holders ({dead}) are dead; start one again, or "
            f"forget a worker that will not return (neuroshard forget-worker)",
            retryable=False,
        )

    async def _dump(
        self, name: str, slots: list[int], budget: list[int | None]
    ) -> dict[int, Batch]:
        """Read ``slots`` from worker ``name`` (``DumpSlots``); slot -> its memories.

        Args:
            name: the primary.
            slots: its slots of the batch.
            budget: ``[bytes]`` the batch's dumps may still bring, shared by its concurrent
                dumps and decreased by each message; ``[None]``: no limit (one slot).

        Raises:
            _BatchTooLarge: the batch's dumps passed the budget (the call is cancelled).
            ExportUnavailable: a slot asked for did not come, or a chunk is malformed.
            grpc.aio.AioRpcError: the call failed.
        """
        rec = self._membership.get(name)
        assert rec is not None  # checked by the caller under the same lock hold
        out: dict[int, list[worker_pb2.SlotData]] = {}
        call = self._clients.stub(name, rec.address).DumpSlots(
            worker_pb2.DumpSlotsRequest(slots=slots, table=self._table), timeout=self._timeout_s
        )
        async for msg in call:
            if budget[0] is not None:
                budget[0] -= msg.ByteSize()
                if budget[0] < 0:
                    call.cancel()
                    raise _BatchTooLarge
            if msg.first:
                out[msg.slot] = []
            out.setdefault(msg.slot, []).append(msg)
        missing = sorted(set(slots) - set(out))
        if missing:
            raise ExportUnavailable(f"primary {name} did not send slots {missing[:5]}")
        try:
            return {s: _assemble(msgs) for s, msgs in out.items()}
        except (CodecError, ValueError) as exc:
            raise ExportUnavailable(f"primary {name} sent a malformed slot: {exc}") from None


def _assemble(msgs: list[worker_pb2.SlotData]) -> Batch:
    """One slot's ``SlotData`` chunks as a batch.

    Raises:
        CodecError: ids or strengths are not whole values.
        ValueError: payload ids and payloads differ in number, or ids and strengths do.
    """
    ids = [ids_from_bytes(m.ids) for m in msgs]
    strengths = [f32_from_bytes(m.strengths, "strengths") for m in msgs]
    batch = Batch(np.concatenate(ids), np.concatenate(strengths))
    if len(batch.ids) != len(batch.strengths):
        raise ValueError(f"{len(batch.ids)} ids and {len(batch.strengths)} strengths")
    for m in msgs:
        batch.payloads.update(zip(m.payload_ids, m.payloads, strict=True))
    return batch
