"""This worker's part of the memory store: slot roles, epoch checks and replication.

The primary of a slot is its single orderer: it applies each mutation, gives it the slot's
next sequence number and forwards it to the slot's replica (and to any worker a slot is being
copied to), and acknowledges only after every copy applied it. A replica applies a primary's
stream in sequence order and never mutates on its own.

Store operations run on one dedicated thread (``self._executor``), so they are applied in
submission order and never block the event loop. ``self._order`` serializes this worker's
primary operations, from apply to the replicas' acks, so each slot's stream stays in order.
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

from shared.proto import common_pb2, worker_pb2
from shared.slots import slot_of
from worker.store import MemoryInputError, SlotSnapshot, SlotStore

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
# A reporter tells the coordinator that a copy on a named worker failed (raising on failure).
Reporter = Callable[[str, str], Awaitable[None]]


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
        if not rid or len(slots) == 0:
            return
        with self._lock:
            self._slots.setdefault(rid, set()).update(np.unique(slots).tolist())
            self._slots.move_to_end(rid)
            while len(self._slots) > self._capacity:
                self._slots.popitem(last=False)


class MemoryNode:
    """Domain logic of the memory RPCs; the servicer maps its exceptions to status codes."""

    def __init__(
        self, name: str, store: SlotStore, forward: Forwarder, report: Reporter
    ) -> None:
        self.name = name
        self.store = store
        self._forward = forward
        self._report = report
        self.recent = RecentRequests()
        self.excluded: set[str] = set()  # copies reported failed; not forwarded to until a new map
        S = store.slots
        self.roles = Roles(0, np.zeros(S, bool), np.zeros(S, bool), [""] * S, {})
        self.pending: dict[int, set[str]] = defaultdict(set)  # slot -> extra copy targets
        self.pending_addresses: dict[str, str] = {}  # copy target -> its address
        self._order = asyncio.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a store operation on the store thread, in submission order."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

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
            self.pending.clear()
            self.pending_addresses.clear()
            self.excluded.clear()
            held = self.store.held_slots()
            fenced = np.asarray(m.primary, np.int64) < 0  # no primary for a moment: keep data
            gone = held[had_role[held] & ~(primary[held] | replica[held]) & ~fenced[held]]
            if len(gone):
                await self.run(self.store.drop_slots, gone)
            return self.roles.epoch

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
        self, epoch: int, op: str, request: Any, ids: np.ndarray,
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
        self, epoch: int, op: str, request: Any, ids: np.ndarray,
        apply: Callable[[np.ndarray], int],
    ) -> int:
        async with self._order:
            self.check_epoch(epoch)
            slots = self._check_primary(ids)
            rid = bytes(request.request_id)
            keep = self.recent.fresh(rid, slots)

            def apply_and_record() -> int:
                n = apply(keep)
                self.recent.record(rid, slots[keep])
                return n

            applied = await self.run(apply_and_record)
            if not keep.all():
                request = _sub_request(op, request, keep)
                ids, slots = ids[keep], slots[keep]
            await self._replicate(op, request, slots, ids)
            return applied

    async def decay(self, epoch: int, rate: float) -> int:
        """Decay every memory of this worker's primary slots and replicate."""
        return await asyncio.shield(self._decay(epoch, rate))

    async def _decay(self, epoch: int, rate: float) -> int:
        async with self._order:
            self.check_epoch(epoch)
            mine = np.flatnonzero(self.roles.primary)
            n = await self.run(self.store.decay, rate, mine)
            req = worker_pb2.WorkerDecayRequest(epoch=epoch, rate=rate)
            await self._replicate("decay", req, mine, None)
            return n

    def _targets(self, touched: np.ndarray) -> dict[str, list[int]]:
        by_target: dict[str, list[int]] = defaultdict(list)
        for s in touched.tolist():
            for target in {self.roles.replica_of[s], *self.pending.get(s, ())}:
                if target and target != self.name and target not in self.excluded:
                    by_target[target].append(s)
        return by_target

    async def _replicate(
        self, op: str, request: Any, slots: np.ndarray, ids: np.ndarray | None
    ) -> None:
        """Bump the touched slots' seqs and forward the op to every other copy, grouped by
        target worker; wait for all acks. A copy that fails is reported to the coordinator
        (which stops trusting it) and excluded; only when that report fails does the write
        fail with ReplicationError."""
        touched = np.unique(slots)
        if len(touched) == 0:
            return
        seqs = self.store.bump_seq(touched)
        seq_of = dict(zip(touched.tolist(), seqs.tolist(), strict=True))
        by_target = self._targets(touched)
        calls = []
        for target, target_slots in by_target.items():
            keep = None if ids is None else np.isin(slots, np.asarray(target_slots))
            sub = request if keep is None or keep.all() else _sub_request(op, request, keep)
            req = worker_pb2.ReplicateRequest(
                primary=self.name, epoch=self.roles.epoch, slots=target_slots,
                seqs=[seq_of[s] for s in target_slots], **{op: sub},
            )
            address = self.roles.addresses.get(target) or self.pending_addresses.get(target, "")
            calls.append(self._forward(target, address, req))
        results = await asyncio.gather(*calls, return_exceptions=True)
        for target, r in zip(by_target, results, strict=True):
            if _is_stale_forward(r):
                continue
            if isinstance(r, BaseException):
                await self._drop_copy(target, f"{type(r).__name__}: {_short(r)}")

    async def _drop_copy(self, target: str, reason: str) -> None:
        try:
            await self._report(target, reason)
        except Exception as exc:
            raise ReplicationError(
                f"replica {target} failed ({reason}) and the coordinator could not be told: "
                f"{_short(exc)}"
            ) from None
        self.excluded.add(target)

    # -- replica side -----------------------------------------------------------------------

    async def apply_replicated(self, req: worker_pb2.ReplicateRequest) -> None:
        """Apply a primary's forwarded op if it is the next in each slot's sequence.

        A repeat of an op already applied (every seq <= current) is acknowledged and ignored.

        Raises:
            OutOfSync: a slot is primary here, or the sequence skips (ABORTED).
        """
        slots = np.asarray(req.slots, np.int64)
        seqs = np.asarray(req.seqs, np.uint64)
        holds = self.roles.primary[slots] | self.roles.replica[slots]
        if req.epoch < self.roles.epoch and not holds.all():
            # This worker has moved on to a map where it holds no copy of these slots; the
            # slots' holders in that map got copies (and the primary's forwards) already.
            raise StaleForward(
                f"forward from {req.primary} at epoch {req.epoch}: {self.name} is at epoch "
                f"{self.roles.epoch} and no longer holds slot {int(slots[~holds][0])}"
            )
        if self.roles.primary[slots].any():
            s = int(slots[self.roles.primary[slots]][0])
            raise OutOfSync(
                f"slot {s} is primary on {self.name}; refusing a forward from "
                f"{req.primary} at epoch {req.epoch}"
            )
        current = self.store.seq[slots]
        if (seqs <= current).all():
            return
        if not (seqs == current + np.uint64(1)).all():
            i = int(np.flatnonzero(seqs != current + np.uint64(1))[0])
            raise OutOfSync(f"slot {slots[i]}: forwarded seq {seqs[i]} after {current[i]}")
        op = req.WhichOneof("op")
        # On the store thread, so apply, seq bump and request record happen together even if
        # the forwarding call is cancelled mid-way.
        await self.run(self._apply_op, op, getattr(req, op), slots)

    def _apply_op(self, op: str, sub: Any, slots: np.ndarray) -> None:
        st = self.store
        if op == "upsert":
            payloads = list(sub.payloads) if len(sub.payloads) else None
            st.upsert(_ids(sub.ids), _f32(sub.strengths), payloads)
        elif op == "reinforce":
            st.reinforce(_ids(sub.ids), _f32(sub.boosts))
        elif op == "delete":
            st.delete(_ids(sub.ids))
        elif op == "decay":
            st.decay(sub.rate, slots)
        st.bump_seq(slots)
        if op != "decay":
            self.recent.record(bytes(sub.request_id), slots)

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

        def work() -> int:
            for snap in snaps:
                self.store.import_slot(snap)
            return sum(len(s.ids) for s in snaps)

        return await self.run(work)


def _ids(b: bytes) -> np.ndarray:
    return np.frombuffer(b, "<u8").astype(np.uint64)


def _f32(b: bytes) -> np.ndarray:
    return np.frombuffer(b, "<f4").astype(np.float32)


def _is_stale_forward(r: object) -> bool:
    code = getattr(r, "code", None)
    return callable(code) and code() is grpc.StatusCode.FAILED_PRECONDITION


def _short(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    return str(details() if callable(details) else exc)[:300]


def _sub_request(op: str, request: Any, keep: np.ndarray) -> Any:
    """The items of a keyed request where keep [N] bool is set, in order."""
    rid = request.request_id
    ids = _ids(request.ids)[keep].astype("<u8").tobytes()
    if op == "upsert":
        payloads = (
            [p for p, k in zip(request.payloads, keep.tolist(), strict=True) if k]
            if len(request.payloads) else []
        )
        return worker_pb2.UpsertRequest(
            epoch=request.epoch, ids=ids, payloads=payloads, request_id=rid,
            strengths=_f32(request.strengths)[keep].astype("<f4").tobytes(),
        )
    if op == "reinforce":
        return worker_pb2.ReinforceRequest(
            epoch=request.epoch, ids=ids, request_id=rid,
            boosts=_f32(request.boosts)[keep].astype("<f4").tobytes(),
        )
    return worker_pb2.DeleteRequest(epoch=request.epoch, ids=ids, request_id=rid)


__all__ = [
    "MemoryInputError", "StaleForward", "MemoryNode", "NotPrimary", "OutOfSync", "ReplicationError",
    "StaleEpoch",
]
