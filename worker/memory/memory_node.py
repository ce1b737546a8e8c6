"""This worker's part of the memory store: the one door to its slot data, replication, journal.

The memory servicer decodes requests and calls the public methods here; nothing else
touches the store, the replicator or the journal.

The primary of a slot is its single orderer: it applies each mutation, gives it the slot's
next sequence number and forwards it to the slot's replica (and to any worker a slot is being
copied to), and acknowledges only after every copy applied it and its journal record is
durable. A replica applies a primary's stream in sequence order and never mutates on its own.

Parts: ``DurableStore`` (the store, its thread, the journal and the recent request ids),
``PrimaryWrites`` (``worker/memory/primary.py``), ``Replicator`` and ``check_forward``
(``worker/memory/replication.py``), ``Placement`` (the slot map as seen here,
``worker/memory/roles.py``). ``self._order`` serializes this worker's primary operations, slot-map
changes and copy snapshots, from apply to the replicas' acks, so each slot's stream stays in order.

Shape letters: N items of a request, T slots an op touches, S slots of the cluster.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np

from shared.memory.stats import Quality
from shared.memory.tables import (
    DEFAULT_TABLE,
    TableNotFound,
    default_spec,
    table_name,
    table_specs,
)
from shared.memory.validation import MemoryInputError, as_slots, validate_k
from shared.proto import common_pb2, worker_pb2
from shared.rpc.codec import ids_from_bytes
from worker.memory.primary import PrimaryWrites, Sweep
from worker.memory.replication import Forwarder, Replicator, Reporter, check_forward
from worker.memory.roles import Placement
from worker.memory.sampling import pick_reply, sums_reply
from worker.store.durable_store import DurableStore, small_write
from worker.store.journal import Journal
from worker.store.journal_format import Request
from worker.store.store import SlotSnapshot, SlotStore
from worker.store.store_metrics import StoreMetrics

__all__ = ["COPY_BATCH_SLOTS", "CappedTable", "MemoryNode", "SlotSender"]

# Slots snapshotted and sent per hold of the write order: writes wait for one batch at most.
COPY_BATCH_SLOTS = 64
# Streams slot snapshots to the named worker at an address; returns (memories, bytes) sent.
SlotSender = Callable[[str, str, list[SlotSnapshot]], Awaitable[tuple[int, int]]]


T = TypeVar("T")

INLINE_GET_IDS = 64  # gets of at most this many ids may skip the store thread
# Quality and top-k may skip the store thread while the worker holds at most this many
# memories (all tables and roles): a pass over half of them takes ~0.1 ms, less than the hop.
INLINE_SCAN_MEMORIES = 131_072


class CappedTable(Exception):
    """An upsert into a table with a capacity that did not come through the coordinator.

    FAILED_PRECONDITION: a capped table's inserts are ordered (stamped) by the coordinator,
    which evicts; a worker refuses one without stamps before applying anything.
    """


class MemoryNode:
    """This worker's memory slots: reads, primary writes, replica applies, copies, maps."""

    def __init__(
        self,
        name: str,
        store: SlotStore,
        forward: Forwarder,
        report: Reporter,
        journal: Journal | None = None,
        requests: list[Request] | None = None,
        ops: StoreMetrics | None = None,
    ) -> None:
        """Build the node of worker ``name`` over its store; it holds no slot until a map comes.

        Args:
            name: this worker's name, as in the slot map.
            store: the slot data (empty, or reloaded from ``journal``).
            forward: sends a primary's op to a peer (see ``Forwarder``).
            report: tells the coordinator a peer's copies stopped being updated (``Reporter``).
            journal: logs every change; None keeps nothing on disk.
            requests: the request ids the journal replayed (with a store reloaded from it).
            ops: counts and times the operations served (one sample per call); None: not.
        """
        self.name = name
        self._ops = ops or StoreMetrics()
        self._store = store
        self._data = DurableStore(store, journal, requests)
        self._replicator = Replicator(name, forward, report)
        self._place = Placement(name, self._held())
        # The tables of the adopted map, by name (the default one: the cluster's limits).
        self._tables = {DEFAULT_TABLE: default_spec(0)}
        # The largest k a client may ask of the top-k read (the adopted map's topk_max).
        self.client_topk_max = 0
        # The most draws a client may pick in one call (the adopted map's max_sample_batch).
        self.client_sample_max = 0
        # Primary writes, slot-map changes and copy snapshots take turns (module docstring).
        self._order = asyncio.Lock()
        self._writes = PrimaryWrites(name, self._data, self._replicator, self._place, self._order)

    # -- state --------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch of the slot map this worker adopted last (0 before any)."""
        return self._place.roles.epoch

    @property
    def num_slots(self) -> int:
        """S, the cluster's slot count this worker's data is laid out for."""
        return self._store.slots

    def __len__(self) -> int:
        """Memories held here, in every role."""
        return len(self._store)

    def primary_memories(self) -> int:
        """Return the number of memories held as primary (reported in heartbeats)."""
        return int(self._store.count(self._primary_slots()))

    def memories_by_role(self) -> dict[str, int]:
        """Return the memories held as primary and as replica (``neuroshard_memories``).

        Reads without the store thread, as heartbeats do: a scrape racing a write may see
        the count before or after it.
        """
        counts = self._store.slot_counts()
        roles = self._place.roles
        return {
            "primary": int(counts[roles.primary].sum()),
            "replica": int(counts[roles.replica].sum()),
        }

    def held_memories(self) -> tuple[list[int], list[int]]:
        """Return the slots held here (either role) with a memory, and their memory counts.

        Reported in heartbeats: the coordinator counts from them what forgetting this worker
        would lose. Read without the store thread, as ``memories_by_role``.

        Returns:
            (slots, counts): two lists of equal length, slots ascending.
        """
        counts = self._store.slot_counts()
        roles = self._place.roles
        held = np.flatnonzero((roles.primary | roles.replica) & (counts > 0))
        return held.tolist(), counts[held].tolist()

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Return every memory held here, sorted by id (diagnostics and tests).

        Returns:
            (ids [N] uint64, strengths [N] float32), host arrays.
        """
        return self._store.items()

    def set_max_payload_bytes(self, max_payload_bytes: int) -> None:
        """Adopt the cluster's payload limit (bytes per memory) for later upserts."""
        self._store.max_payload_bytes = max_payload_bytes

    def table(self, name: str) -> common_pb2.TableSpec:
        """Return the spec of the table a request names (empty: the default one).

        Raises:
            TableNotFound: the adopted slot map has no such table (NOT_FOUND).
        """
        spec = self._tables.get(table_name(name))
        if spec is None:
            raise TableNotFound(f"table {table_name(name)!r} does not exist")
        return spec

    def tables(self) -> list[str]:
        """Return the names of the tables of the adopted map, the default one first."""
        return [DEFAULT_TABLE, *sorted(n for n in self._tables if n != DEFAULT_TABLE)]

    def table_items(self, table: str) -> tuple[np.ndarray, np.ndarray]:
        """Return every memory of one table held here, sorted by id (diagnostics and tests)."""
        return self._store.items(table_name(table))

    def close(self) -> None:
        """Finish the running store job, then close the journal (fsync per its policy)."""
        self._data.close()

    def abandon(self) -> None:
        """Stop as a killed process would: no fsync, queued store jobs dropped.

        Tests crash and restart a worker in one process with it.
        """
        self._data.abandon()

    def _primary_slots(self) -> np.ndarray:
        """Return the slots primary here, ascending, int64."""
        return np.flatnonzero(self._place.roles.primary)

    def _held(self) -> np.ndarray:
        """Return [S] bool: slots with data or a history here."""
        return (self._store.slot_counts() > 0) | (self._store.seq > 0)

    # -- slot map -----------------------------------------------------------------------------

    async def apply_slot_map(self, m: common_pb2.SlotMap) -> int:
        """Adopt a newer slot map; drop the data of slots whose role this worker loses.

        A map of an epoch already applied is ignored (the coordinator re-sends maps to
        workers it believes are behind). Data of slots this worker had no role for is kept:
        it may be a copy received for the map the coordinator is about to publish.

        Args:
            m: a validated slot map (``shared.memory.slots.validate_slot_map``).

        Returns:
            The epoch this worker is at afterwards.
        """
        async with self._order:
            if m.epoch <= self.epoch:
                return self.epoch
            # Every slot counts as held: one that looks empty may have a forward queued on
            # the store thread, which the drop (queued after it) must remove too.
            gone = self._place.adopt(m, np.ones(self.num_slots, bool))
            fenced = bool((np.asarray(m.primary, np.int64) < 0).any())
            primary = self._place.roles.primary
            self._replicator.adopt(primary if fenced else np.zeros_like(primary))
            if len(gone):
                await self._data.run(self._data.drop, gone)
            specs = table_specs(m)
            self._tables = specs
            self.client_topk_max = int(m.topk_max)
            self.client_sample_max = int(m.max_sample_batch)
            await self._data.run(self._adopt_tables, specs)
            return self.epoch

    def _adopt_tables(self, specs: dict[str, common_pb2.TableSpec]) -> None:
        """On the store thread: drop the tables the map lacks, take the listed ones' ids."""
        for name in self._store.tables():
            if name not in specs:
                self._data.drop_table(name)
        for name, spec in specs.items():
            if name != DEFAULT_TABLE:
                self._data.adopt_table(name, spec.id)

    def check_epoch(self, epoch: int) -> None:
        """Raises: StaleEpoch when ``epoch`` is not this worker's epoch (FAILED_PRECONDITION)."""
        self._place.check_epoch(epoch)

    # -- reads (primary slots) ------------------------------------------------------------------

    async def get(
        self,
        epoch: int,
        ids: np.ndarray,
        with_payloads: bool = False,
        max_reply_bytes: int | None = None,
        table: str = DEFAULT_TABLE,
    ) -> worker_pb2.GetResponse:
        """Look memories up in their primary slots, once per distinct id.

        The reply answers each distinct id once, in the order of its first occurrence in
        ``ids`` (for ids without repeats: the request's order). De-duplication, the reply's
        size check and its bytes are done on the store thread, off the event loop.

        Args:
            epoch: the epoch the request was routed with.
            ids: [N] uint64, repeats allowed.
            with_payloads: also answer the payloads.
            max_reply_bytes: the largest reply, bytes (``max_message_bytes``); None: no limit.
            table: the table read.

        Returns:
            found [M] uint8, strengths [M] float32 (0 where not found) and, with payloads,
            M payloads (empty where missing), for the M distinct ids.

        Raises:
            StaleEpoch, NotPrimary: (FAILED_PRECONDITION).
            TableNotFound: no such table (NOT_FOUND).
            BudgetExceeded: the reply would exceed ``max_reply_bytes`` (RESOURCE_EXHAUSTED);
                nothing of it is built.
        """
        self.check_epoch(epoch)
        name = self.table(table).name
        self._place.check_primary(ids)
        with self._ops.op("get"):
            # A few ids are read on the loop when the store thread is idle (no hand-off).
            run = self._data.run_small if len(ids) <= INLINE_GET_IDS else self._data.run
            return await run(self._store.get_reply, ids, with_payloads, max_reply_bytes, name)

    async def quality(self, epoch: int, table: str = DEFAULT_TABLE) -> Quality:
        """Summarize the strengths of one table in this worker's primary slots.

        Raises:
            StaleEpoch: (FAILED_PRECONDITION). TableNotFound: (NOT_FOUND).
        """
        self.check_epoch(epoch)
        name = self.table(table).name
        with self._ops.op("quality"):
            return await self._scan(self._store.quality, self._primary_slots(), name)

    async def candidates(
        self, epoch: int, k: int, order: str, table: str
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """Return a table's count in the primary slots and its first k there to evict.

        Args:
            epoch: the epoch the request was routed with.
            k: how many, >= 1.
            order: "oldest" (insert stamp, then id) or "weakest" (strength, then id).
            table: the table.

        Returns:
            ``(ids [k'] uint64, strengths [k'] float32, stamps [k'] uint64, count)``.

        Raises:
            StaleEpoch: (FAILED_PRECONDITION). TableNotFound: (NOT_FOUND).
            MemoryInputError: an unknown order (INVALID_ARGUMENT).
        """
        self.check_epoch(epoch)
        name = self.table(table).name
        with self._ops.op("candidates"):
            return await self._data.run(
                self._store.candidates, k, order, self._primary_slots(), name
            )

    async def topk(
        self, epoch: int, k: int, table: str = DEFAULT_TABLE
    ) -> tuple[np.ndarray, np.ndarray]:
        """Return the k strongest memories of the primary slots (ties: smaller id first).

        Returns:
            (ids [k'] uint64, strengths [k'] float32), k' = min(k, memories).

        Raises:
            StaleEpoch: (FAILED_PRECONDITION). TableNotFound: (NOT_FOUND).
            MemoryInputError: k < 1 or above the store's limit (INVALID_ARGUMENT).
        """
        self.check_epoch(epoch)
        name = self.table(table).name
        k = validate_k(k, self._store.k_max)
        with self._ops.op("topk"):
            return await self._scan(self._store.topk, k, self._primary_slots(), name)

    async def _scan(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a read pass over the primary slots: on the loop when short and idle.

        A small store is read on the event loop when the store thread is idle
        (``run_small``: the state is the one the thread would show), saving the hand-off.
        """
        if len(self._store) <= INLINE_SCAN_MEMORIES:
            return await self._data.run_small(fn, *args)
        return await self._data.run(fn, *args)

    async def sample_sums(
        self, epoch: int, alpha: float, uniform: bool, table: str = ""
    ) -> worker_pb2.WorkerSampleSumsResponse:
        """Phase 1 of a sample: the weight sum of each primary slot (``worker/memory/sampling.py``).

        Raises:
            StaleEpoch: (FAILED_PRECONDITION). TableNotFound: (NOT_FOUND).
        """
        self.check_epoch(epoch)
        name = self.table(table).name
        primary = self._primary_slots()
        with self._ops.op("sample_sums"):
            return await self._data.run(sums_reply, self._store, alpha, uniform, primary, name)

    async def sample_pick(
        self,
        epoch: int,
        version: int,
        slots: np.ndarray,
        offsets: np.ndarray,
        with_payloads: bool,
        max_reply_bytes: int | None = None,
        table: str = "",
    ) -> worker_pb2.WorkerSamplePickResponse:
        """Phase 2 of a sample: the memories at draws (slot [K] int64, offset [K] uint64).

        Raises:
            StaleEpoch, NotPrimary: (FAILED_PRECONDITION). TableNotFound: (NOT_FOUND).
            BudgetExceeded: the reply would exceed ``max_reply_bytes`` (RESOURCE_EXHAUSTED).
        """
        self.check_epoch(epoch)
        name = self.table(table).name
        self._place.check_primary_slots(slots)
        with self._ops.op("sample_pick"):
            return await self._data.run(
                pick_reply,
                self._store,
                version,
                slots,
                offsets,
                with_payloads,
                max_reply_bytes,
                name,
            )

    # -- primary writes -------------------------------------------------------------------------

    async def upsert(
        self,
        request: worker_pb2.UpsertRequest,
        ids: np.ndarray,
        strengths: np.ndarray,
        payloads: list[bytes] | None,
    ) -> int:
        """Insert or overwrite memories as primary, then replicate; return the count applied.

        Args:
            request: the client's request (forwarded to the replica as it is, or its part).
            ids: [N] uint64, decoded from the request.
            strengths: [N] float32, in [0, 1].
            payloads: [N] bytes, or None for no payloads (always None for a priority
                update, ``request.existing_only``: only the ids present are written).

        Raises:
            StaleEpoch, NotPrimary: (FAILED_PRECONDITION).
            MemoryInputError: invalid values, or a payload over the table's limit; nothing
                applied (INVALID_ARGUMENT).
            TableNotFound: no such table; nothing applied (NOT_FOUND).
            CappedTable: a capped table's upsert without the coordinator's stamps
                (FAILED_PRECONDITION); nothing applied.
            ReplicationError: a copy failed, the coordinator could not be told (UNAVAILABLE);
                also a retry while the first attempt's copies are still unconfirmed.
            StorageFailed: the journal failed to write or fsync, now or before; the write is
                not acknowledged, nor is any later one (UNAVAILABLE).
        """
        self.check_epoch(request.epoch)  # a lagging map may lack the table: stale first
        spec = self.table(request.table)
        limit = spec.max_payload_bytes or None
        stamps = ids_from_bytes(request.stamps, "stamps") if request.stamps else None
        if stamps is not None and len(stamps) != len(ids):
            raise MemoryInputError(f"ids and stamps differ in length ({len(ids)} != {len(stamps)})")
        if spec.capacity and stamps is None and not request.existing_only:  # an insert
            raise CappedTable(
                f"table {spec.name!r} has a capacity: insert through the coordinator "
                "(Client.upsert does), which orders its inserts and evicts"
            )

        def apply(keep: np.ndarray) -> int:
            kept = (
                None if payloads is None else [p for p, k in zip(payloads, keep, strict=True) if k]
            )
            kept_stamps = None if stamps is None else stamps[keep]
            return self._store.upsert(
                ids[keep],
                strengths[keep],
                kept,
                request.existing_only,
                spec.name,
                limit,
                kept_stamps,
            )

        with self._ops.op("upsert"):
            return await self._writes.keyed(request.epoch, "upsert", request, ids, apply)

    async def reinforce(
        self, request: worker_pb2.ReinforceRequest, ids: np.ndarray, boosts: np.ndarray
    ) -> int:
        """Add boosts (duplicates sum) and clip to [0, 1] as primary, then replicate.

        Args:
            request: the client's request, as for ``upsert``.
            ids: [N] uint64, decoded from the request.
            boosts: [N] float32, finite and >= 0.

        Returns:
            The number of ids found.

        Raises:
            StaleEpoch, NotPrimary, MemoryInputError, ReplicationError, StorageFailed,
                TableNotFound: as ``upsert``.
        """
        self.check_epoch(request.epoch)  # a lagging map may lack the table: stale first
        name = self.table(request.table).name

        def apply(keep: np.ndarray) -> int:
            return self._store.reinforce(ids[keep], boosts[keep], name)

        with self._ops.op("reinforce"):
            return await self._writes.keyed(request.epoch, "reinforce", request, ids, apply)

    async def delete(self, request: worker_pb2.DeleteRequest, ids: np.ndarray) -> int:
        """Delete memories as primary, then replicate; return the ids found.

        Args:
            request: the client's request, as for ``upsert``.
            ids: [N] uint64, decoded from the request.

        Raises:
            StaleEpoch, NotPrimary, ReplicationError, StorageFailed, TableNotFound: as
                ``upsert``.
        """
        self.check_epoch(request.epoch)  # a lagging map may lack the table: stale first
        name = self.table(request.table).name

        def apply(keep: np.ndarray) -> int:
            return self._store.delete(ids[keep], name)

        with self._ops.op("delete"):
            return await self._writes.keyed(request.epoch, "delete", request, ids, apply)

    async def decay(
        self, epoch: int, rate: float, op_id: bytes = b"", table: str = DEFAULT_TABLE
    ) -> int:
        """Decay every memory of one table in this worker's primary slots and replicate.

        Args:
            epoch: the epoch the request was routed with.
            rate: subtracted from each strength, in [0, 1] (validated by the caller).
            op_id: the decay's operation id; slots that applied it already are skipped
                (empty: no de-duplication).
            table: the table decayed.

        Returns:
            The number of memories of the primary slots that have now applied the decay
            (this call or an earlier one with the same ``op_id``).

        Raises:
            StaleEpoch: (FAILED_PRECONDITION). TableNotFound: (NOT_FOUND).
            StorageFailed: the journal failed; nothing applied (UNAVAILABLE).
            ReplicationError: as ``upsert`` (UNAVAILABLE).
        """
        spec = self.table(table)
        self._data.check_writable()
        with self._ops.op("decay"):
            return await self._writes.decay(epoch, rate, op_id, spec.name, _forget(spec))

    async def sweep(
        self,
        epoch: int,
        rate: float,
        op_id: bytes,
        k: int,
        want_quality: bool,
        table: str = DEFAULT_TABLE,
    ) -> tuple[int, Sweep]:
        """Decay one table's primary slots (as ``decay``), then summarize them, take the top-k.

        One pass over the strengths (``SlotStore.sweep``); equal to ``decay`` followed by
        ``quality`` and ``topk``. A rate of 0 is a read: no decay is recorded or forwarded.

        Args:
            epoch: the epoch the request was routed with.
            rate: subtracted from each strength, in [0, 1] (validated by the caller).
            op_id: the decay's operation id, as for ``decay``.
            k: top-k size; 0: no top-k.
            want_quality: compute the statistics.
            table: the table swept.

        Returns:
            (memories of the primary slots that have applied the decay, (quality or None,
            (ids [k'] uint64, strengths [k'] float32) or None)).

        Raises:
            StaleEpoch: (FAILED_PRECONDITION). TableNotFound: (NOT_FOUND).
            MemoryInputError: k above the store's limit (INVALID_ARGUMENT).
            StorageFailed, ReplicationError: as ``decay`` (UNAVAILABLE).
        """
        spec = self.table(table)
        k = validate_k(k, self._store.k_max) if k else 0
        if rate > 0:
            self._data.check_writable()
        with self._ops.op("sweep"):
            return await self._writes.sweep(
                epoch, rate, op_id, k, want_quality, spec.name, _forget(spec)
            )

    # -- replica side ---------------------------------------------------------------------------

    async def apply_replicated(self, req: worker_pb2.ReplicateRequest) -> None:
        """Apply a primary's forwarded op if it is the next in each slot's sequence.

        A repeat of an op already applied (every seq <= current) is acknowledged and ignored.
        A forward from an older epoch is applied to the slots this worker still holds.

        Raises:
            StaleForward: from an older epoch, for no slot held here (FAILED_PRECONDITION).
            OutOfSync: a slot is primary here, or the sequence skips (ABORTED).
            MemoryInputError: a slot out of range, seqs not one per slot, or no op
                (INVALID_ARGUMENT).
            StorageFailed: the journal failed; not acknowledged (UNAVAILABLE).
        """
        place = self._place
        part = check_forward(req, place.roles, place.incoming, self._store.seq, self.name)
        if part is None:
            await self._data.sync_all()  # applied by an earlier call: durable as it is
            return
        with self._ops.op("replicate"):
            # In one store job, so apply, seq bump, request record and log record happen
            # together even if the forwarding call is cancelled mid-way; a keyed op of a few
            # ids runs on the loop when the store thread is idle (one synchronous call).
            run = self._data.run_small if _inline_forward(part[0]) else self._data.run
            pos = await run(self._data.apply_forward, *part)
            await self._data.sync(pos)

    # -- copies ---------------------------------------------------------------------------------

    async def copy_to(
        self, target: str, address: str, slots: list[int], send: SlotSender
    ) -> tuple[int, int]:
        """Copy slots to worker ``target`` (before the coordinator switches the map).

        In batches of ``COPY_BATCH_SLOTS``, under this worker's write order: snapshot the
        batch, forward later writes of its slots to ``target`` too, and ``send`` it, so no
        write falls between a snapshot and its copy.

        Returns:
            (memories, bytes) sent, as ``send`` counts them.

        Raises:
            ReplicationError: ``send`` failed (UNAVAILABLE); whatever else ``send`` raises.
        """
        with self._ops.op("copy"):
            return await self._copy_to(target, address, slots, send)

    async def _copy_to(
        self, target: str, address: str, slots: list[int], send: SlotSender
    ) -> tuple[int, int]:
        memories = nbytes = 0
        for i in range(0, len(slots), COPY_BATCH_SLOTS):
            batch = slots[i : i + COPY_BATCH_SLOTS]
            async with self._order:
                snaps = await self._data.run(self._export, batch)
                self._replicator.add_copy(batch, target, address)
                m, b = await send(target, address, snaps)
            memories, nbytes = memories + m, nbytes + b
        return memories, nbytes

    async def import_snapshots(self, snaps: list[SlotSnapshot]) -> int:
        """Install copied slots (each replaces what was held for it); return memories added."""

        def work() -> int:
            pos = self._data.import_slots(snaps)
            self._place.received(sorted({snap.slot for snap in snaps}))
            return pos

        with self._ops.op("import"):
            pos = await self._data.run(work)
            await self._data.sync(pos)
        return sum(len(s.ids) for s in snaps)

    async def export_slots(
        self, slots: list[int], table: str = DEFAULT_TABLE
    ) -> list[SlotSnapshot]:
        """Snapshot one table's part of slots as held here (none given: every slot holding it).

        Raises:
            MemoryInputError: a slot out of range (INVALID_ARGUMENT).
        """
        name = table_name(table)
        chosen = (
            as_slots(slots, self._store.slots).tolist()
            or np.flatnonzero(self._store.slot_counts(name)).tolist()
        )
        return await self._data.run(self._data.export, chosen, name)

    def slot_seqs(self, slots: list[int]) -> list[int]:
        """Return the sequence number of each slot as held here (0: no data).

        Raises:
            MemoryInputError: a slot out of range (INVALID_ARGUMENT).
        """
        return [int(s) for s in self._store.seq[as_slots(slots, self._store.slots)]]

    def _export(self, slots: list[int]) -> list[SlotSnapshot]:
        """On the store thread: copy out ``slots``, with the request ids each applied."""
        return self._data.export(slots)


def _forget(spec: common_pb2.TableSpec) -> float | None:
    """A table's ``forget_below`` as the store takes it (None: the table forgets nothing)."""
    return None if spec.forget_below < 0 else float(spec.forget_below)


def _inline_forward(req: worker_pb2.ReplicateRequest) -> bool:
    """True for a forwarded keyed op light enough to apply inline (never a decay)."""
    op = req.WhichOneof("op")
    return op is not None and small_write(op, getattr(req, op))
