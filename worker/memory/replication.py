"""Replication of a slot's mutations from its primary to its other copies.

Primary side (``Replicator``): an applied op goes, with the seq each slot took, to the slot's
replica and to every worker a copy of the slot is being made for (``add_copy``, until the next
map). A copy whose forward fails is reported to the coordinator (which stops trusting it) and
excluded from later forwards until the next map; only when that report fails is the write
refused (``ReplicationError``), so no copy is silently left behind. Such an error carries the
forwards left unconfirmed; a client's retry of the write re-sends them (``redrive``) and is
acknowledged only once each was applied or its target distrusted (a replica's seq check makes
a re-sent forward idempotent).

Replica side (``check_forward``): a forward is applied only as the next op of each of its
slots' sequences; a repeat is acknowledged and ignored, a gap is refused (``OutOfSync``), and
a forward from an older epoch is narrowed to the slots this worker still holds.

Shape letters: N items of a keyed op, T slots an op touches, S slots of the cluster.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np

from shared.memory.validation import (
    MemoryInputError,
    as_slots,
    validate_op_id,
    validate_request_id,
)
from shared.proto import worker_pb2
from shared.rpc import error_message
from shared.rpc.codec import f32_from_bytes, f32_to_bytes, ids_from_bytes, ids_to_bytes
from worker.memory.roles import Roles
from worker.memory.wire import narrow, sub_request

__all__ = [
    "Forwarder",
    "Forwards",
    "OutOfSync",
    "ReplicationError",
    "Replicator",
    "Reporter",
    "StaleForward",
    "check_forward",
]

# Sends one ReplicateRequest to the named worker at an address (raises on failure; a
# grpc.aio.AioRpcError with FAILED_PRECONDITION is the target's StaleForward).
Forwarder = Callable[[str, str, worker_pb2.ReplicateRequest], Awaitable[None]]
# Tells the coordinator that the copies of some slots on a named worker are no longer
# updated, and why (raises on failure).
Reporter = Callable[[str, list[int], str], Awaitable[None]]
# The forwards of one applied op: target worker -> (its address, its part of the op).
Forwards = dict[str, tuple[str, worker_pb2.ReplicateRequest]]


class ReplicationError(Exception):
    """A copy failed and the coordinator could not be told (UNAVAILABLE).

    Also: a slot copy could not be sent. The write or copy is not acknowledged.

    Attributes:
        unconfirmed: the forwards of the write that no trusted copy confirmed (empty for a
            slot copy); a retry of the write must re-send them.
    """

    def __init__(self, message: str, unconfirmed: Forwards | None = None) -> None:
        super().__init__(message)
        self.unconfirmed: Forwards = unconfirmed or {}


class StaleForward(Exception):
    """A forward from an older epoch for slots no longer held here (FAILED_PRECONDITION).

    The primary ignores this answer: the slots' current holders have the op.
    """


class OutOfSync(Exception):
    """A forwarded op skips sequence numbers or targets a slot primary here (ABORTED)."""


class Replicator:
    """The primary side: who receives each slot's ops besides this worker, and sending them."""

    def __init__(self, name: str, forward: Forwarder, report: Reporter) -> None:
        """Start with no copy in progress and none excluded.

        Args:
            name: this worker's name (never a target of its own forwards).
            forward: sends a forward to a peer.
            report: tells the coordinator about a copy that stopped being updated.
        """
        self.name = name
        self._forward = forward
        self._report = report
        self._pending: dict[int, set[str]] = defaultdict(set)  # slot -> copy targets
        self._addresses: dict[str, str] = {}  # copy target -> its address
        self._excluded: dict[str, set[int]] = {}  # target -> slots reported failed there

    def add_copy(self, slots: list[int], target: str, address: str) -> None:
        """Forward later ops of ``slots`` to ``target`` (at ``address``) as well.

        A new copy of a slot to a target that was excluded for it (an earlier copy or
        forward failed, without a new map since) ends that exclusion: the copy is taken now,
        so the target is in step again and must get every later op, or it would become a
        stale holder in the map this copy is made for.
        """
        for s in slots:
            self._pending[s].add(target)
        self._excluded.get(target, set()).difference_update(slots)
        self._addresses[target] = address

    def adopt(self, keep: np.ndarray) -> None:
        """On a new map: forget every exclusion and the copy targets of slots not in ``keep``.

        A new map normally ends the copies (its holders have the data), but the fence map
        comes between the copies and the target map and moves no holder: the primaries it
        keeps go on accepting writes, which must still reach the copies.

        Args:
            keep: [S] bool, the slots still primary here when the map fences some slot,
                else none.
        """
        kept = {s: targets for s, targets in self._pending.items() if keep[s]}
        self._pending = defaultdict(set, kept)
        fed = set().union(*kept.values())
        self._addresses = {t: a for t, a in self._addresses.items() if t in fed}
        self._excluded.clear()

    def targets(self, roles: Roles, touched: np.ndarray) -> dict[str, list[int]]:
        """Return target worker -> the slots of ``touched`` ([T] int64) it receives."""
        by_target: dict[str, list[int]] = defaultdict(list)
        if not self._pending and not self._excluded:  # the usual case: replicas only
            replica_of = roles.replica_of
            for s in touched.tolist():
                target = replica_of[s]
                if target and target != self.name:
                    by_target[target].append(s)
            return by_target
        for s in touched.tolist():
            for target in {roles.replica_of[s], *self._pending.get(s, ())}:
                if target and target != self.name and s not in self._excluded.get(target, ()):
                    by_target[target].append(s)
        return by_target

    async def forward(
        self,
        roles: Roles,
        op: str,
        request: Any,
        slots: np.ndarray,
        ids: np.ndarray | None,
        touched: np.ndarray,
        seqs: np.ndarray,
    ) -> None:
        """Send an applied op to every other copy, each target its slots' part, and wait.

        Args:
            roles: the roles the op was applied under.
            op: "upsert", "reinforce", "delete" or "decay".
            request: the op's request message (as applied: without repeated items).
            slots: [N] int64 slot of each item.
            ids: [N] uint64 the items' ids; None for decay.
            touched: [T] int64 the distinct slots of ``slots``, ascending.
            seqs: [T] uint64 the seq each of ``touched`` took.

        Raises:
            ReplicationError: a copy failed and the coordinator could not be told
                (UNAVAILABLE).
        """
        seq_of = dict(zip(touched.tolist(), seqs.tolist(), strict=True))
        forwards: Forwards = {}
        split = _Split(op, request, slots, len(roles.primary)) if ids is not None else None
        for target, target_slots in self.targets(roles, touched).items():
            # A target with every touched slot (the usual case with two workers, and for a
            # decay) gets the request as it came: its bytes are not decoded or re-encoded.
            whole = split is None or len(target_slots) == len(touched)
            sub = request if whole or split is None else split.part(target_slots)
            req = worker_pb2.ReplicateRequest(
                primary=self.name,
                epoch=roles.epoch,
                slots=target_slots,
                seqs=[seq_of[s] for s in target_slots],
                **{op: sub},
            )
            address = roles.addresses.get(target) or self._addresses.get(target, "")
            forwards[target] = (address, req)
        await self._send(roles, forwards)

    async def redrive(self, roles: Roles, forwards: Forwards) -> None:
        """Re-send an op's unconfirmed forwards (a client retried it); wait for them.

        A target whose copies of the forward's slots were reported failed since is skipped:
        the coordinator no longer trusts them. A target that applied the forward already
        acknowledges it again and applies nothing (``check_forward``).

        Args:
            roles: this worker's roles now.
            forwards: ``ReplicationError.unconfirmed`` of an earlier attempt.

        Raises:
            ReplicationError: as ``forward``, with the forwards still unconfirmed.
        """
        trusted = {
            target: (address, req)
            for target, (address, req) in forwards.items()
            if not set(req.slots) <= self._excluded.get(target, set())
        }
        await self._send(roles, trusted)

    async def _send(self, roles: Roles, forwards: Forwards) -> None:
        """Send each target its forward; report the failed ones; wait for all.

        Raises:
            ReplicationError: some target failed and the coordinator could not be told; it
                carries those targets' forwards (UNAVAILABLE).
        """
        results = await asyncio.gather(
            *(self._forward(t, address, req) for t, (address, req) in forwards.items()),
            return_exceptions=True,
        )
        unconfirmed: Forwards = {}
        errors: list[str] = []
        for (target, sent), r in zip(forwards.items(), results, strict=True):
            if isinstance(r, BaseException) and not _is_stale_forward(r):
                try:
                    await self._drop_copy(roles, target, error_message(r))
                except ReplicationError as exc:
                    unconfirmed[target] = sent
                    errors.append(str(exc))
        if unconfirmed:
            raise ReplicationError("; ".join(errors), unconfirmed)

    async def _drop_copy(self, roles: Roles, target: str, reason: str) -> None:
        """Stop updating every copy this primary feeds on ``target``, once the coordinator knows.

        Its replica slots and pending copies alike, so no slot is silently left stale.
        """
        pending = {s for s, targets in self._pending.items() if target in targets}
        slots = sorted(roles.replica_slots_of(target) | pending)
        try:
            await self._report(target, slots, reason)
        except Exception as exc:
            raise ReplicationError(
                f"replica {target} failed ({reason}) and the coordinator could not be told: "
                f"{error_message(exc)}"
            ) from None
        self._excluded.setdefault(target, set()).update(slots)


class _Split:
    """The parts of a keyed request per target: decoded once, sliced once per target.

    Shape letters: N items of the request, S slots of the cluster.
    """

    def __init__(self, op: str, request: Any, slots: np.ndarray, num_slots: int) -> None:
        """Split ``request`` (an ``op`` request, N items in ``slots`` [N] int64) later."""
        self._op, self._request, self._slots = op, request, slots
        self._num_slots = num_slots
        self._ids: np.ndarray | None = None
        self._values: np.ndarray | None = None

    def part(self, target_slots: list[int]) -> Any:
        """Return the request's items in ``target_slots``, in request order.

        Raises:
            CodecError: the request's bulk fields are not whole values (INVALID_ARGUMENT).
        """
        in_target = np.zeros(self._num_slots, bool)
        in_target[target_slots] = True
        keep = in_target[self._slots]
        req, op = self._request, self._op
        if op == "upsert" and (len(req.payloads) or req.stamps):
            return sub_request(op, req, keep)  # payloads or stamps: the general path
        if self._ids is None:  # each bytes field is read (copied out of the message) once
            self._ids = ids_from_bytes(req.ids)
            if op in ("upsert", "reinforce"):
                field = "strengths" if op == "upsert" else "boosts"
                self._values = f32_from_bytes(getattr(req, field), field)
        ids = ids_to_bytes(self._ids[keep])
        rid = req.request_id
        table = req.table  # a forward names the table its request named
        if op == "delete":
            return worker_pb2.DeleteRequest(epoch=req.epoch, ids=ids, request_id=rid, table=table)
        assert self._values is not None
        values = f32_to_bytes(self._values[keep])
        if op == "upsert":
            return worker_pb2.UpsertRequest(
                epoch=req.epoch,
                ids=ids,
                strengths=values,
                request_id=rid,
                existing_only=req.existing_only,
                table=table,
            )
        return worker_pb2.ReinforceRequest(
            epoch=req.epoch, ids=ids, boosts=values, request_id=rid, table=table
        )


def check_forward(
    req: worker_pb2.ReplicateRequest,
    roles: Roles,
    incoming: np.ndarray,
    seq: np.ndarray,
    name: str,
) -> tuple[worker_pb2.ReplicateRequest, np.ndarray] | None:
    """Decide what a replica applies of a primary's forward.

    Args:
        req: the forward.
        roles: this worker's roles.
        incoming: [S] bool, slots whose copy was received for a map not adopted yet (their
            primary's forwards count as held even from an older epoch).
        seq: [S] uint64, the seq of each slot as held here.
        name: this worker's name (for messages).

    Returns:
        None when every slot already applied the op (a repeat: acknowledge, apply nothing);
        else the forward to apply (narrowed to the slots still held) and its [T] int64 slots.

    Raises:
        StaleForward: the forward is from an older epoch and this worker holds none of its
            slots any more (FAILED_PRECONDITION).
        OutOfSync: a slot is primary here, or the sequence skips (ABORTED).
        MemoryInputError: a slot out of range, seqs not one per slot, or no op
            (INVALID_ARGUMENT).
    """
    slots = _forward_slots(req, len(seq))
    holds = roles.holds(slots) | incoming[slots]
    if req.epoch < roles.epoch and not holds.all():
        # This worker has moved on to a map where it holds no copy of some of these slots;
        # their holders in that map got copies (and the primary's forwards) already. A copy
        # received for a map still to come counts as held: an intermediate map (the fence)
        # gives it no role yet, but the target will. The slots still held take their part of
        # the op, or their next forward would skip this seq (the primary counts a stale
        # answer as delivered).
        if not holds.any():
            raise StaleForward(
                f"forward from {req.primary} at epoch {req.epoch}: {name} is at "
                f"epoch {roles.epoch} and no longer holds slot {int(slots[0])}"
            )
        req, slots = narrow(req, holds, len(seq)), slots[holds]
    if roles.primary[slots].any():
        s = int(slots[roles.primary[slots]][0])
        raise OutOfSync(
            f"slot {s} is primary on {name}; refusing a forward from {req.primary} at epoch "
            f"{req.epoch}"
        )
    return None if _is_repeat(req, slots, seq) else (req, slots)


def _forward_slots(req: worker_pb2.ReplicateRequest, num_slots: int) -> np.ndarray:
    """Return [T] int64 the forward's slots.

    Raises:
        MemoryInputError: a slot out of range, seqs not one per slot, no op, or a request
            or op id over 64 bytes (INVALID_ARGUMENT).
    """
    slots = as_slots(list(req.slots), num_slots)
    op = req.WhichOneof("op")
    if len(req.seqs) != len(slots) or op is None:
        raise MemoryInputError(
            f"a forward needs one seq per slot and an op: {len(req.seqs)} seqs for "
            f"{len(slots)} slots, op {op}"
        )
    sub = getattr(req, op)
    if op == "decay":
        validate_op_id(sub.op_id)
    else:
        validate_request_id(sub.request_id, f"{op}.request_id")
    return slots


def _is_repeat(req: worker_pb2.ReplicateRequest, slots: np.ndarray, seq: np.ndarray) -> bool:
    """True when every slot already took the forward's seq; False when it is each one's next.

    Raises:
        OutOfSync: otherwise (a gap, or a mix of both) (ABORTED).
    """
    # fromiter: np.asarray reads a repeated field item by item through the sequence
    # protocol (~80 us for 170 seqs, on every forward a replica applies).
    seqs, current = np.fromiter(req.seqs, np.uint64, len(req.seqs)), seq[slots]
    if (seqs <= current).all():
        return True
    if not (seqs == current + np.uint64(1)).all():
        i = int(np.flatnonzero(seqs != current + np.uint64(1))[0])
        raise OutOfSync(f"slot {slots[i]}: forwarded seq {seqs[i]} after {current[i]}")
    return False


def _is_stale_forward(r: BaseException) -> bool:
    """True for a peer's FAILED_PRECONDITION answer (its StaleForward)."""
    code = getattr(r, "code", None)
    return callable(code) and code() is grpc.StatusCode.FAILED_PRECONDITION
