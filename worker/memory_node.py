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
from collections import defaultdict
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

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


class MemoryNode:
    """Domain logic of the memory RPCs; the servicer maps its exceptions to status codes."""

    def __init__(self, name: str, store: SlotStore, forward: Forwarder) -> None:
        self.name = name
        self.store = store
        self._forward = forward
        S = store.slots
        self.roles = Roles(0, np.zeros(S, bool), np.zeros(S, bool), [""] * S, {})
        self.pending: dict[int, set[str]] = defaultdict(set)  # slot -> extra copy targets
        self._order = asyncio.Lock()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="store")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a store operation on the store thread, in submission order."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # -- slot map -------------------------------------------------------------------------

    async def apply_slot_map(self, m: common_pb2.SlotMap) -> int:
        """Adopt a new slot map; drop the data of slots this worker no longer holds."""
        async with self._order:
            if m.epoch < self.roles.epoch:
                return self.roles.epoch
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
            held = self.store.held_slots()
            gone = held[~(primary[held] | replica[held])]
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
        self, epoch: int, op: str, request: Any, ids: np.ndarray, apply: Callable[[], int]
    ) -> int:
        """Apply a keyed mutation as primary, then replicate it; return the applied count.

        Raises:
            StaleEpoch, NotPrimary (FAILED_PRECONDITION); MemoryInputError (INVALID_ARGUMENT,
            raised by ``apply`` before any change); ReplicationError (UNAVAILABLE).
        """
        async with self._order:
            self.check_epoch(epoch)
            slots = self._check_primary(ids)
            applied = await self.run(apply)
            await self._replicate(op, request, slots, ids)
            return applied

    async def decay(self, epoch: int, rate: float) -> int:
        """Decay every memory of this worker's primary slots and replicate."""
        async with self._order:
            self.check_epoch(epoch)
            mine = np.flatnonzero(self.roles.primary)
            n = await self.run(self.store.decay, rate, mine)
            req = worker_pb2.WorkerDecayRequest(epoch=epoch, rate=rate)
            await self._replicate("decay", req, mine, None)
            return n

    async def _replicate(
        self, op: str, request: Any, slots: np.ndarray, ids: np.ndarray | None
    ) -> None:
        """Bump the touched slots' seqs and forward the op to every other copy, grouped by
        target worker; wait for all acks."""
        touched = np.unique(slots)
        if len(touched) == 0:
            return
        seqs = self.store.bump_seq(touched)
        seq_of = dict(zip(touched.tolist(), seqs.tolist(), strict=True))
        by_target: dict[str, list[int]] = defaultdict(list)
        for s in touched.tolist():
            for target in {self.roles.replica_of[s], *self.pending.get(s, ())} - {"", self.name}:
                by_target[target].append(s)
        calls = []
        for target, target_slots in by_target.items():
            sub = _sub_request(op, request, ids, slots, target_slots)
            req = worker_pb2.ReplicateRequest(
                primary=self.name,
                epoch=self.roles.epoch,
                slots=target_slots,
                seqs=[seq_of[s] for s in target_slots],
                **{op: sub},
            )
            calls.append(self._forward(target, self.roles.addresses.get(target, ""), req))
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise ReplicationError(f"replication failed: {errors[0]}")

    # -- replica side -----------------------------------------------------------------------

    async def apply_replicated(self, req: worker_pb2.ReplicateRequest) -> None:
        """Apply a primary's forwarded op if it is the next in each slot's sequence.

        A repeat of an op already applied (every seq <= current) is acknowledged and ignored.

        Raises:
            OutOfSync: a slot is primary here, or the sequence skips (ABORTED).
        """
        slots = np.asarray(req.slots, np.int64)
        seqs = np.asarray(req.seqs, np.uint64)
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

    # -- copies -----------------------------------------------------------------------------

    async def export_for_copy(self, slots: list[int], target: str) -> list[SlotSnapshot]:
        """Snapshot slots for a copy to ``target`` and forward later writes there too.

        Must be called with ``self._order`` held (see ``copy_lock``) so that no write falls
        between the snapshot and the registration.
        """
        snaps = await self.run(lambda: [self.store.export_slot(s) for s in slots])
        for s in slots:
            self.pending[s].add(target)
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


def _sub_request(
    op: str, request: Any, ids: np.ndarray | None, slots: np.ndarray, target_slots: list[int]
) -> Any:
    """The part of a keyed request whose ids fall in ``target_slots`` (order kept)."""
    if ids is None:
        return request
    keep = np.isin(slots, np.asarray(target_slots))
    if keep.all():
        return request
    if op == "upsert":
        payloads = (
            [p for p, k in zip(request.payloads, keep, strict=True) if k]
            if len(request.payloads)
            else []
        )
        return worker_pb2.UpsertRequest(
            epoch=request.epoch,
            ids=_ids(request.ids)[keep].astype("<u8").tobytes(),
            strengths=_f32(request.strengths)[keep].astype("<f4").tobytes(),
            payloads=payloads,
        )
    if op == "reinforce":
        return worker_pb2.ReinforceRequest(
            epoch=request.epoch,
            ids=_ids(request.ids)[keep].astype("<u8").tobytes(),
            boosts=_f32(request.boosts)[keep].astype("<f4").tobytes(),
        )
    return worker_pb2.DeleteRequest(
        epoch=request.epoch, ids=_ids(request.ids)[keep].astype("<u8").tobytes()
    )


__all__ = [
    "MemoryInputError",
    "MemoryNode",
    "NotPrimary",
    "OutOfSync",
    "ReplicationError",
    "StaleEpoch",
]
