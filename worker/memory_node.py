"""This worker's part of the memory store: slot roles, epoch checks and replication.

The primary of a slot is its single orderer: it applies each mutation, gives it the slot's
next sequence number and forwards it to the slot's replica (and to any worker a slot is being
copied to), and acknowledges only after every copy applied it. A replica applies a primary's
stream in sequence order and never mutates on its own.

Store operations run on one dedicated thread (``self._executor``), so they are applied in
submission order and never block the event loop. ``self._order`` serializes this worker's
primary operations, from apply to the replicas' acks, so each slot's stream stays in order.

With a journal (``worker/journal.py``) every change of the store (a primary's op with its new
seqs, a replica's applied forward, an imported or dropped slot) is logged in the same store
thread job that applies it, and a write is acknowledged only once its record is durable.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np

from shared.memory.slots import slot_of
from shared.memory.validation import MemoryInputError, as_slots
from shared.proto import common_pb2, worker_pb2
from shared.rpc import error_message
from worker.journal import Journal
from worker.journal_format import Request, apply_op
from worker.store import SlotSnapshot, SlotStore

T = TypeVar("T")


class StaleEpoch(Exception):
    """The request was routed with another slot-map epoch (FAILED_PRECONDITION)."""


class NotPrimary(Exception):
    """An id's slot is not primary here at this epoch (FAILED_PRECONDITION)."""


class ReplicationError(Exception):
    """A replica refused or could not be reached (UNAVAILABLE); the write is not acknowledged."""


class StaleForward(Exception):
    """A forward from an older epoch for a slot this worker no longer holds
    (FAILED_PRECONDITION); the primary ignores it: the slot's current holders have the op."""


class OutOfSync(Exception):
    """A forwarded op skips sequence numbers or targets a slot not held here (ABORTED)."""


@dataclass
class Roles:
    """The slot map as seen by this worker."""

    epoch: int
    primary: np.ndarray  # [S] bool: primary here
    replica: np.ndarray  # [S] bool: replica here
    replica_of: list[str]  # [S] name of each slot's replica ("" when none)
    addresses: dict[str, str]


# A forwarder sends one ReplicateRequest to a named worker (raising on failure).
Forwarder = Callable[[str, str, worker_pb2.ReplicateRequest], Awaitable[None]]
# A reporter tells the coordinator that the copies of some slots on a named worker are no
# longer updated, and why (raising on failure).
Reporter = Callable[[str, list[int], str], Awaitable[None]]


class RecentRequests:
    """Which slots applied each recent client request id (bounded LRU), so that a retry of a
    write that was applied but not acknowledged is not applied again."""

    def __init__(self, capacity: int = 8192) -> None:
        self._capacity = capacity
        self._slots: OrderedDict[bytes, set[int]] = OrderedDict()
        self._lock = threading.Lock()  # read on the event loop, written on the store thread

    def fresh(self, rid: bytes, slots: np.ndarray) -> np.ndarray:
        """keep [N] bool: items whose slot has not applied ``rid`` yet."""
        with self._lock:
            done = list(self._slots.get(rid, ())) if rid else []
        if not done:
            return np.ones(len(slots), bool)
        return ~np.isin(slots, np.asarray(done, np.int64))

    def record(self, rid: bytes, slots: np.ndarray) -> None:
        """Note that ``slots`` ([K] int64) applied request ``rid``."""
        if not rid or len(slots) == 0:
            return
        with self._lock:
            self._slots.setdefault(rid, set()).update(slots.tolist())  # a set: repeats are harmless
            self._slots.move_to_end(rid)
            while len(self._slots) > self._capacity:
                self._slots.popitem(last=False)

    def entries(self) -> list[Request]:
        """Every (request id, slots) held, oldest first (what a journal snapshot keeps)."""
        with self._lock:
            return [(rid, sorted(slots)) for rid, slots in self._slots.items()]


class MemoryNode:
    """Domain logic of the memory RPCs; the servicer maps its exceptions to status codes."""

    def __init__(
        self,
        name: str,
        store: SlotStore,
        forward: Forwarder,
        report: Reporter,
        journal: Journal | None = None,
        requests: list[Request] | None = None,
    ) -> None:
        """``journal`` logs every change; ``requests`` are the request ids the journal
        replayed (with a store reloaded from it)."""
        self.name = name
        self.store = store
        self._forward = forward
        self._report = report
        self.journal = journal
        self.recent = RecentRequests()
        for rid, slots in requests or []:
            self.recent.record(rid, np.asarray(slots, np.int64))
        # target -> slots reported failed there; not forwarded to until a new map
        self.excluded: dict[str, set[int]] = {}
        S = store.slots
        # Reloaded data is kept until the first map says which slots this worker holds (the
        # coordinator sends it only once it has compared them with the other holders').
        self._reloaded: np.ndarray | None = (store.slot_counts() > 0) | (store.seq > 0)
        self.roles = Roles(0, np.zeros(S, bool), np.zeros(S, bool), [""] * S, {})
        self.pending: dict[int, set[str]] = defaultdict(set)  # slot -> extra copy targets
        # [S] bool: slots whose copy was received for a map not adopted yet (no role here
        # yet); their primary's forwards are applied even when they come from an older epoch.
        self.incoming = np.zeros(S, bool)
        self.pending_addresses: dict[str, str] = {}  # copy target -> its address
        self._order = asyncio.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a store operation on the store thread, in submission order."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        """Finish the running store job, then close the journal (fsync per its policy)."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self.journal is not None:
            self.journal.close()

    async def _sync(self, pos: int) -> None:
        """Wait until the journal holds everything up to ``pos`` durably (policy permitting)."""
        if self.journal is not None:
            await self.journal.sync(pos)

    def _log(self, pos: int) -> int:
        """After a journal append on the store thread: snapshot if the log grew too long."""
        if self.journal is not None:
            self.journal.maybe_snapshot(self.store, self.recent.entries)
        return pos

    # -- slot map -------------------------------------------------------------------------

    async def apply_slot_map(self, m: common_pb2.SlotMap) -> int:
        """Adopt a newer slot map; drop the data of slots whose role this worker loses.

        A map of an epoch already applied is ignored (the coordinator re-sends maps to
        workers it believes are behind). Data of slots this worker had no role for is kept:
        it may be a copy received for the map the coordinator is about to publish.
        """
        async with self._order:
            if m.epoch <= self.roles.epoch:
                return self.roles.epoch
            had_role = self.roles.primary | self.roles.replica
            if self._reloaded is not None:
                had_role, self._reloaded = had_role | self._reloaded, None
            me = list(m.workers).index(self.name) if self.name in m.workers else -2
            primary = np.asarray(m.primary, np.int64) == me
            replica = np.asarray(m.replica, np.int64) == me
            names = list(m.workers)
            replica_of = [names[r] if r >= 0 else "" for r in m.replica]
            self.roles = Roles(
                int(m.epoch),
                primary,
                replica,
                replica_of,
                dict(zip(m.workers, m.addresses, strict=True)),
            )
            self.incoming &= ~(primary | replica)
            fenced = np.asarray(m.primary, np.int64) < 0  # no primary for a moment: keep data
            self._keep_pending(primary if fenced.any() else np.zeros_like(primary))
            self.excluded.clear()
            held = np.flatnonzero((self.store.slot_counts() > 0) | (self.store.seq > 0))
            gone = held[had_role[held] & ~(primary[held] | replica[held]) & ~fenced[held]]
            if len(gone):
                self.incoming[gone] = False
                await self.run(self._drop, gone)
            return self.roles.epoch

    def _keep_pending(self, keep: np.ndarray) -> None:
        """Forget the copy targets of slots other than ``keep`` [S] bool.

        A new map normally ends the copies (its holders have the data), but the fence map
        comes between the copies and the target map and moves no holder: the primaries it
        keeps go on accepting writes, which must still reach the copies (so ``keep`` is the
        slots still primary here when the map fences some slot, else none).
        """
        kept = {s: targets for s, targets in self.pending.items() if keep[s]}
        self.pending = defaultdict(set, kept)
        fed = set().union(*kept.values())
        self.pending_addresses = {t: a for t, a in self.pending_addresses.items() if t in fed}

    def _drop(self, slots: np.ndarray) -> None:
        self.store.drop_slots(slots)
        if self.journal is not None:
            self._log(self.journal.log_drop(slots))

    def check_epoch(self, epoch: int) -> None:
        """Raises: StaleEpoch when ``epoch`` is not this worker's epoch."""
        if epoch != self.roles.epoch:
            newer = "newer" if epoch < self.roles.epoch else "older"
            raise StaleEpoch(
                f"slot map epoch {epoch} does not match this worker's epoch "
                f"{self.roles.epoch} ({newer} map here); refresh the slot map and retry"
            )

    def _check_primary(self, ids: np.ndarray) -> np.ndarray:
        slots = slot_of(ids, self.store.slots)
        wrong = np.flatnonzero(~self.roles.primary[slots])
        if len(wrong):
            i = int(wrong[0])
            raise NotPrimary(
                f"ids[{i}] ({ids[i]}) is in slot {slots[i]}, which is not primary on worker "
                f"{self.name} at epoch {self.roles.epoch}"
            )
        return slots

    # -- primary operations ----------------------------------------------------------------

    async def mutate(
        self,
        epoch: int,
        op: str,
        request: Any,
        ids: np.ndarray,
        apply: Callable[[np.ndarray], int],
    ) -> int:
        """Apply a keyed mutation as primary, then replicate it; return the applied count.

        Items whose slot already applied this ``request.request_id`` (a client retry after a
        failure) are skipped, so a retried reinforce is not applied twice.

        Args:
            apply: called on the store thread with keep [N] bool (the items to apply).

        Raises:
            StaleEpoch, NotPrimary (FAILED_PRECONDITION); MemoryInputError (INVALID_ARGUMENT,
            raised by ``apply`` before any change); ReplicationError (UNAVAILABLE).
        """
        # Shielded: once applied here, the op must reach the replica and be recorded even if
        # the client's call is cancelled, or the two copies would diverge.
        return await asyncio.shield(self._mutate(epoch, op, request, ids, apply))

    async def _mutate(
        self,
        epoch: int,
        op: str,
        request: Any,
        ids: np.ndarray,
        apply: Callable[[np.ndarray], int],
    ) -> int:
        async with self._order:
            self.check_epoch(epoch)
            slots = self._check_primary(ids)
            rid = bytes(request.request_id)
            keep = self.recent.fresh(rid, slots)
            if not keep.all():
                request = _sub_request(op, request, keep)
                slots, ids = slots[keep], ids[keep]
            touched = np.unique(slots)  # once per write: record, seqs and forwards share it

            def apply_and_record() -> tuple[int, np.ndarray, int]:
                n = apply(keep)
                self.recent.record(rid, touched)
                return n, *self._commit(op, request, touched)

            applied, seqs, pos = await self.run(apply_and_record)
            await self._replicate(op, request, slots, ids, touched, seqs, pos)
            return applied

    async def decay(self, epoch: int, rate: float) -> int:
        """Decay every memory of this worker's primary slots and replicate."""
        return await asyncio.shield(self._decay(epoch, rate))

    async def _decay(self, epoch: int, rate: float) -> int:
        async with self._order:
            self.check_epoch(epoch)
            mine = np.flatnonzero(self.roles.primary)
            req = worker_pb2.WorkerDecayRequest(epoch=epoch, rate=rate)

            def apply_and_record() -> tuple[int, np.ndarray, int]:
                return self.store.decay(rate, mine), *self._commit("decay", req, mine)

            n, seqs, pos = await self.run(apply_and_record)
            await self._replicate("decay", req, mine, None, mine, seqs, pos)
            return n

    def _commit(self, op: str, sub: Any, touched: np.ndarray) -> tuple[np.ndarray, int]:
        """On the store thread, right after applying: give each touched slot (ascending,
        distinct) its next seq and log the op; return (seqs, journal position)."""
        seqs = self.store.bump_seq(touched)
        if self.journal is None or not len(touched):
            return seqs, 0
        req = worker_pb2.ReplicateRequest(
            primary=self.name,
            epoch=self.roles.epoch,
            slots=touched.tolist(),
            seqs=seqs.tolist(),
            **{op: sub},
        )
        return seqs, self._log(self.journal.log_op(req))

    def _targets(self, touched: np.ndarray) -> dict[str, list[int]]:
        by_target: dict[str, list[int]] = defaultdict(list)
        for s in touched.tolist():
            for target in {self.roles.replica_of[s], *self.pending.get(s, ())}:
                if target and target != self.name and s not in self.excluded.get(target, ()):
                    by_target[target].append(s)
        return by_target

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
        """Forward an applied op to every other copy, grouped by target worker, and wait for
        all acks and for the op's journal record (``pos``) to be durable. A copy that fails is
        reported to the coordinator (which stops trusting it) and excluded; only when that
        report fails does the write fail with ReplicationError.

        Args:
            slots: [K] int64 slot of each item (ids [K] uint64; None for decay).
            touched: [T] int64 the distinct slots of ``slots``, ascending.
            seqs: [T] uint64 the seq each of ``touched`` took.
        """
        if len(touched) == 0:
            return
        durable = asyncio.ensure_future(self._sync(pos))
        try:
            await self._forward_all(op, request, slots, ids, touched, seqs)
        finally:
            await durable

    async def _forward_all(
        self,
        op: str,
        request: Any,
        slots: np.ndarray,
        ids: np.ndarray | None,
        touched: np.ndarray,
        seqs: np.ndarray,
    ) -> None:
        seq_of = dict(zip(touched.tolist(), seqs.tolist(), strict=True))
        by_target = self._targets(touched)
        calls = []
        for target, target_slots in by_target.items():
            keep = None if ids is None else np.isin(slots, np.asarray(target_slots))
            sub = request if keep is None or keep.all() else _sub_request(op, request, keep)
            req = worker_pb2.ReplicateRequest(
                primary=self.name,
                epoch=self.roles.epoch,
                slots=target_slots,
                seqs=[seq_of[s] for s in target_slots],
                **{op: sub},
            )
            address = self.roles.addresses.get(target) or self.pending_addresses.get(target, "")
            calls.append(self._forward(target, address, req))
        results = await asyncio.gather(*calls, return_exceptions=True)
        for target, r in zip(by_target, results, strict=True):
            if _is_stale_forward(r):
                continue
            if isinstance(r, BaseException):
                await self._drop_copy(target, error_message(r))

    async def _drop_copy(self, target: str, reason: str) -> None:
        """Stop updating every copy this primary feeds on ``target`` (its replica slots and
        pending copies), once the coordinator knows, so no slot is silently left stale."""
        slots = sorted(
            {
                s
                for s in np.flatnonzero(self.roles.primary).tolist()
                if self.roles.replica_of[s] == target
            }
            | {s for s, targets in self.pending.items() if target in targets}
        )
        try:
            await self._report(target, slots, reason)
        except Exception as exc:
            raise ReplicationError(
                f"replica {target} failed ({reason}) and the coordinator could not be told: "
                f"{error_message(exc)}"
            ) from None
        self.excluded.setdefault(target, set()).update(slots)

    # -- replica side -----------------------------------------------------------------------

    async def apply_replicated(self, req: worker_pb2.ReplicateRequest) -> None:
        """Apply a primary's forwarded op if it is the next in each slot's sequence.

        A repeat of an op already applied (every seq <= current) is acknowledged and ignored.
        A forward from an older epoch is applied to the slots this worker still holds.

        Raises:
            StaleForward: the forward is from an older epoch and this worker holds none of
                its slots any more (FAILED_PRECONDITION).
            OutOfSync: a slot is primary here, or the sequence skips (ABORTED).
            MemoryInputError: a slot out of range, seqs not one per slot, or no op
                (INVALID_ARGUMENT).
        """
        slots = as_slots(list(req.slots), self.store.slots)
        if len(req.seqs) != len(slots) or req.WhichOneof("op") is None:
            raise MemoryInputError(
                f"a forward needs one seq per slot and an op: {len(req.seqs)} seqs for "
                f"{len(slots)} slots, op {req.WhichOneof('op')}"
            )
        seqs = np.asarray(req.seqs, np.uint64)
        holds = self.roles.primary[slots] | self.roles.replica[slots] | self.incoming[slots]
        if req.epoch < self.roles.epoch and not holds.all():
            # This worker has moved on to a map where it holds no copy of some of these
            # slots; their holders in that map got copies (and the primary's forwards)
            # already. A copy received for a map still to come counts as held: an
            # intermediate map (the fence) gives it no role yet, but the target will. The
            # slots still held take their part of the op, or their next forward would skip
            # this seq (the primary counts a stale answer as delivered).
            if not holds.any():
                raise StaleForward(
                    f"forward from {req.primary} at epoch {req.epoch}: {self.name} is at "
                    f"epoch {self.roles.epoch} and no longer holds slot {int(slots[0])}"
                )
            req, slots = _narrow(req, holds, self.store.slots), slots[holds]
            seqs = np.asarray(req.seqs, np.uint64)
        if self.roles.primary[slots].any():
            s = int(slots[self.roles.primary[slots]][0])
            raise OutOfSync(
                f"slot {s} is primary on {self.name}; refusing a forward from "
                f"{req.primary} at epoch {req.epoch}"
            )
        current = self.store.seq[slots]
        if (seqs <= current).all():
            if self.journal is not None:  # applied by an earlier call: durable as it is
                await self._sync(self.journal.written)
            return
        if not (seqs == current + np.uint64(1)).all():
            i = int(np.flatnonzero(seqs != current + np.uint64(1))[0])
            raise OutOfSync(f"slot {slots[i]}: forwarded seq {seqs[i]} after {current[i]}")
        # On the store thread, so apply, seq bump, request record and log record happen
        # together even if the forwarding call is cancelled mid-way.
        pos = await self.run(self._apply_op, req, slots)
        await self._sync(pos)

    def _apply_op(self, req: worker_pb2.ReplicateRequest, slots: np.ndarray) -> int:
        op = req.WhichOneof("op")
        rid = apply_op(self.store, op, getattr(req, op), slots)
        self.store.bump_seq(slots)
        self.recent.record(rid, slots)
        return self._log(self.journal.log_op(req)) if self.journal is not None else 0

    # -- copies -----------------------------------------------------------------------------

    async def export_for_copy(
        self, slots: list[int], target: str, address: str
    ) -> list[SlotSnapshot]:
        """Snapshot slots for a copy to ``target`` and forward later writes there too.

        Must be called with ``self._order`` held (see ``copy_lock``) so that no write falls
        between the snapshot and the registration.
        """
        snaps = await self.run(lambda: [self.store.export_slot(s) for s in slots])
        for s in slots:
            self.pending[s].add(target)
        self.pending_addresses[target] = address
        return snaps

    @property
    def copy_lock(self) -> asyncio.Lock:
        return self._order

    async def import_snapshots(self, snaps: list[SlotSnapshot]) -> int:
        """Install copied slots (replacing what was held for them); return memories added."""

        def work() -> tuple[int, int]:
            pos = 0
            self.store.import_slots(snaps)  # one merge for the whole batch of slots
            for snap in snaps:
                self.incoming[snap.slot] = True
                if self._reloaded is not None:
                    self._reloaded[snap.slot] = False
                if self.journal is not None:
                    pos = self._log(self.journal.log_import(snap))
            return sum(len(s.ids) for s in snaps), pos

        n, pos = await self.run(work)
        await self._sync(pos)
        return n


def _ids(b: bytes) -> np.ndarray:
    return np.frombuffer(b, "<u8").astype(np.uint64)


def _f32(b: bytes) -> np.ndarray:
    return np.frombuffer(b, "<f4").astype(np.float32)


def _is_stale_forward(r: object) -> bool:
    code = getattr(r, "code", None)
    return callable(code) and code() is grpc.StatusCode.FAILED_PRECONDITION


def _narrow(
    req: worker_pb2.ReplicateRequest, keep_slots: np.ndarray, num_slots: int
) -> worker_pb2.ReplicateRequest:
    """The part of a forward that touches the slots where keep_slots [T] bool is set (T the
    forward's slots): those slots and seqs, and the items (for keyed ops) in them."""
    op = req.WhichOneof("op")
    slots = np.asarray(req.slots, np.int64)
    sub = getattr(req, op)
    if op != "decay":
        keep = np.isin(slot_of(_ids(sub.ids), num_slots), slots[keep_slots])
        sub = _sub_request(op, sub, keep)
    return worker_pb2.ReplicateRequest(
        primary=req.primary,
        epoch=req.epoch,
        slots=slots[keep_slots].tolist(),
        seqs=np.asarray(req.seqs, np.uint64)[keep_slots].tolist(),
        **{op: sub},
    )


def _sub_request(op: str, request: Any, keep: np.ndarray) -> Any:
    """The items of a keyed request where keep [N] bool is set, in order."""
    rid = request.request_id
    ids = _ids(request.ids)[keep].astype("<u8").tobytes()
    if op == "upsert":
        payloads = (
            [p for p, k in zip(request.payloads, keep.tolist(), strict=True) if k]
            if len(request.payloads)
            else []
        )
        return worker_pb2.UpsertRequest(
            epoch=request.epoch,
            ids=ids,
            payloads=payloads,
            request_id=rid,
            strengths=_f32(request.strengths)[keep].astype("<f4").tobytes(),
        )
    if op == "reinforce":
        return worker_pb2.ReinforceRequest(
            epoch=request.epoch,
            ids=ids,
            request_id=rid,
            boosts=_f32(request.boosts)[keep].astype("<f4").tobytes(),
        )
    return worker_pb2.DeleteRequest(epoch=request.epoch, ids=ids, request_id=rid)


__all__ = [
    "StaleForward",
    "MemoryNode",
    "NotPrimary",
    "OutOfSync",
    "ReplicationError",
    "StaleEpoch",
]
