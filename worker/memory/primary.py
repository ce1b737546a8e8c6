"""The primary's write path: every mutation of a slot is ordered, applied and replicated here.

Under this worker's write order (one ``asyncio.Lock`` shared with slot-map changes and copy
snapshots): check the epoch and that every item's slot is primary here, leave out the items
whose slot already applied the request id (a client retry), apply and commit (next seqs,
journal record) in one store-thread job (on the loop for a few ids when that thread is
idle: ``DurableStore.run_small``), then forward to every other copy while the record
becomes durable. Both waits end before the lock is released, so each slot's forwards leave in
seq order.

A retry is acknowledged only once every trusted copy has the request: when its first attempt
failed with a forward neither applied nor reported to the coordinator, the retry re-sends
those forwards first (``Replicator.redrive``) and fails UNAVAILABLE again if they still cannot
be confirmed. A write whose forwards were all confirmed costs its retries one dict lookup.

Shape letters: N items of a keyed write, T slots it touches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from shared.memory.stats import Quality
from shared.memory.tables import DEFAULT_TABLE
from shared.memory.validation import validate_rate
from shared.proto import worker_pb2
from worker.memory.replication import ReplicationError, Replicator
from worker.memory.roles import Placement
from worker.memory.wire import sub_request
from worker.store.durable_store import DurableStore, small_write

__all__ = ["PrimaryWrites", "Sweep"]

# A sweep's answer: the statistics and the top-k (ids [k'] uint64, strengths [k'] float32),
# each None when not asked for.
Sweep = tuple[Quality | None, tuple[np.ndarray, np.ndarray] | None]


class PrimaryWrites:
    """Keyed writes and decay as this worker's primary slots' single orderer."""

    def __init__(
        self,
        name: str,
        data: DurableStore,
        replicator: Replicator,
        place: Placement,
        order: asyncio.Lock,
    ) -> None:
        """Write through ``data`` and ``replicator`` under ``order``.

        Args:
            name: this worker's name (the ``primary`` of its forwards and log records).
            data: the store, its thread and journal.
            replicator: sends applied ops to the other copies.
            place: this worker's roles (epoch and primary checks).
            order: this worker's write order.
        """
        self._name = name
        self._data = data
        self._replicator = replicator
        self._place = place
        self._order = order

    async def keyed(
        self, epoch: int, op: str, request: Any, ids: np.ndarray, apply: Callable[..., int]
    ) -> int:
        """Apply a keyed op as primary, then replicate it; return the count applied.

        Shielded: once applied here, the op must reach the replica and be recorded even if the
        client's call is cancelled, or the two copies would diverge.

        Args:
            epoch: the epoch the request was routed with.
            op: "upsert", "reinforce" or "delete".
            request: the op's request message (its ``request_id`` de-duplicates retries).
            ids: [N] uint64, decoded from the request.
            apply: ``apply(keep [N] bool) -> count`` applies the kept items to the store; it
                runs on the store thread. Items whose slot already applied the request id
                are left out of ``keep``.

        Raises:
            StaleEpoch, NotPrimary: (FAILED_PRECONDITION); nothing applied.
            StorageFailed: the journal failed earlier; nothing applied (UNAVAILABLE).
            MemoryInputError: raised by ``apply`` before any change (INVALID_ARGUMENT).
            ReplicationError: a copy failed, the coordinator could not be told (UNAVAILABLE);
                also for a retry whose earlier attempt's copies still cannot be confirmed.
        """
        return await asyncio.shield(self._keyed(epoch, op, request, ids, apply))

    async def decay(
        self,
        epoch: int,
        rate: float,
        op_id: bytes = b"",
        table: str = DEFAULT_TABLE,
        forget_below: float | None = None,
    ) -> int:
        """Decay every memory of the primary slots by ``rate``, then replicate (shielded).

        A decay is applied once per slot: the slots that applied ``op_id`` already (a retry
        of the coordinator or the client, or a forward received before this copy was
        promoted) are left out, and the others record it, as do their replicas.

        Args:
            epoch: the epoch the request was routed with.
            rate: subtracted from each strength, in [0, 1].
            op_id: the decay's operation id (empty: no de-duplication).
            table: the table decayed.
            forget_below: as ``sweep``'s.

        Returns:
            The number of memories of the primary slots that have applied the decay, now or
            by an earlier delivery of ``op_id`` (a retry counts the same as the first call).

        Raises:
            StaleEpoch: (FAILED_PRECONDITION). ReplicationError: as ``keyed`` (UNAVAILABLE).
        """
        return await asyncio.shield(self._decay(epoch, rate, op_id, table, forget_below))

    async def _keyed(
        self, epoch: int, op: str, request: Any, ids: np.ndarray, apply: Callable[..., int]
    ) -> int:
        async with self._order:
            self._place.check_epoch(epoch)
            slots = self._place.check_primary(ids)
            self._data.check_writable()
            rid = bytes(request.request_id)
            await self._confirm(rid)
            keep = self._data.recent.fresh(rid, slots)
            if not keep.all():
                request = sub_request(op, request, keep)
                slots, ids = slots[keep], ids[keep]
            # Once per write (record, seqs and forwards share it); a count per slot is O(N + S)
            # where np.unique sorts (0.03 vs 0.5 ms for 33k items).
            touched = np.flatnonzero(np.bincount(slots, minlength=len(self._place.incoming)))

            def apply_and_commit() -> tuple[int, np.ndarray, int]:
                self._data.check_writable()
                n = apply(keep)
                self._data.recent.record(rid, touched)
                return n, *self._data.commit(op, request, touched, epoch, self._name)

            # A few ids are applied and logged on the loop when the store thread is idle.
            run = self._data.run_small if small_write(op, request) else self._data.run
            applied, seqs, pos = await run(apply_and_commit)
            try:
                await self._replicate(op, request, slots, ids, touched, seqs, pos)
            except ReplicationError as exc:
                self._data.recent.hold(rid, exc.unconfirmed)  # for the client's retry
                raise
            return applied

    async def _confirm(self, rid: bytes) -> None:
        """Re-send the forwards an earlier attempt of ``rid`` left unconfirmed, if any.

        Raises:
            ReplicationError: some still cannot be confirmed (UNAVAILABLE); they stay held.
        """
        unconfirmed = self._data.recent.unconfirmed(rid)
        if unconfirmed is None:
            return
        try:
            await self._replicator.redrive(self._place.roles, unconfirmed)
        except ReplicationError as exc:
            self._data.recent.hold(rid, exc.unconfirmed)
            raise
        self._data.recent.confirm(rid)

    async def _decay(
        self, epoch: int, rate: float, op_id: bytes, table: str, forget_below: float | None
    ) -> int:
        n, _ = await self._sweep(epoch, rate, op_id, 0, False, table, forget_below)
        return n

    async def sweep(
        self,
        epoch: int,
        rate: float,
        op_id: bytes,
        k: int,
        want_quality: bool,
        table: str = DEFAULT_TABLE,
        forget_below: float | None = None,
    ) -> tuple[int, Sweep]:
        """Decay the primary slots as ``decay`` does, then summarize them, in one pass.

        The statistics and top-k cover every primary slot (those that applied ``op_id``
        before included) as they are after the decay. A rate of 0 changes nothing: nothing
        is recorded, logged or forwarded.

        Args:
            epoch: the epoch the request was routed with.
            rate: subtracted from each strength, in [0, 1].
            op_id: the decay's operation id (empty: no de-duplication).
            k: top-k size, 0 (none) to the store's ``k_max``.
            want_quality: compute the statistics.
            table: the table swept (the op id is recorded per slot, whatever the table).
            forget_below: the table's ``forget_below`` (None: none): the decay then removes
                the memories it leaves at or below it, here and, through the forward, on
                every copy.

        Returns:
            (memories of the primary slots that have applied the decay, the store's
            ``sweep`` answer: quality or None, top-k or None).

        Raises:
            StaleEpoch: (FAILED_PRECONDITION). ReplicationError: as ``keyed`` (UNAVAILABLE).
            MemoryInputError: k out of range (INVALID_ARGUMENT); nothing applied.
        """
        if rate == 0:
            self._place.check_epoch(epoch)
            primary = np.flatnonzero(self._place.roles.primary)
            store = self._data.store

            def read() -> tuple[int, Sweep]:
                answer = store.sweep(None, primary, k, want_quality, None, table)
                return store.count(primary, table), answer

            return await self._data.run(read)
        return await asyncio.shield(
            self._sweep(epoch, rate, op_id, k, want_quality, table, forget_below)
        )

    async def _sweep(
        self,
        epoch: int,
        rate: float,
        op_id: bytes,
        k: int,
        want_quality: bool,
        table: str,
        forget_below: float | None = None,
    ) -> tuple[int, Sweep]:
        """Pipelined: the decay is logged and forwarded before this copy's pass over it.

        The store job takes the slots' seqs and logs the decay (starting its fsync), tells
        the loop, which forwards it to the replicas, and then makes the fused pass; so the
        replicas' apply and fsync overlap with it. Rate and k are validated before anything
        is logged, so the pass cannot fail after its record.
        """
        async with self._order:
            self._place.check_epoch(epoch)
            validate_rate(rate)
            primary = np.flatnonzero(self._place.roles.primary)
            fresh = self._data.recent.fresh(op_id, primary)
            mine = primary[fresh]
            part = None if fresh.all() else mine
            wire_table = "" if table == DEFAULT_TABLE else table
            req = worker_pb2.WorkerDecayRequest(
                epoch=epoch, rate=rate, op_id=op_id, table=wire_table, forget_below=forget_below
            )
            store, data = self._data.store, self._data
            loop = asyncio.get_running_loop()
            logged: asyncio.Future[tuple[np.ndarray, int]] = loop.create_future()

            def log_then_sweep() -> tuple[int, Sweep]:
                data.check_writable()
                seqs, pos = data.commit("decay", req, mine, epoch, self._name, applied=False)
                data.recent.record(op_id, mine)
                loop.call_soon_threadsafe(_settle, logged, (seqs, pos))
                answer = store.sweep(rate, primary, k, want_quality, part, table, forget_below)
                data.settled()
                return store.count(primary, table), answer

            job = asyncio.ensure_future(data.run(log_then_sweep))
            either: set[asyncio.Future[Any]] = {logged, job}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not logged.done():  # refused before anything was logged or applied
                return await job
            seqs, pos = logged.result()
            try:
                await self._replicate("decay", req, mine, None, mine, seqs, pos)
            finally:
                result = await job  # the pass ends before the order is released
            return result

    async def _replicate(
        self,
        op: str,
        request: Any,
        slots: np.ndarray,
        ids: np.ndarray | None,
        touched: np.ndarray,
        seqs: np.ndarray,
        pos: int,
    ) -> None:
        """Forward an applied op to every other copy while its journal record becomes durable.

        Returns when both are done: ``Replicator.forward`` and the sync to ``pos``.
        """
        if len(touched) == 0:
            return
        durable = asyncio.ensure_future(self._data.sync(pos))
        try:
            roles = self._place.roles
            await self._replicator.forward(roles, op, request, slots, ids, touched, seqs)
        finally:
            await durable


def _settle(fut: asyncio.Future[tuple[np.ndarray, int]], value: tuple[np.ndarray, int]) -> None:
    if not fut.done():
        fut.set_result(value)
