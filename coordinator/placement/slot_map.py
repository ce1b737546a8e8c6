"""The slot map and the plan that moves the cluster from one map to the next.

The map says which worker is primary and which is replica of each hash slot. A change goes
in two published steps so that a slot is never served by a worker without its data: first
an *interim* map that keeps only live workers that hold the data (a dead primary's replica
is promoted at once), then, after the copies, the *target* map given by rendezvous hashing
over the live workers (``shared.memory.slots.assign_slots``). A slot whose only trusted
copies are on dead workers can stay with them (``keep_lost``): it is unavailable until one
comes back with its data dir, rather than restarted empty.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.memory.slots import assign_slots
from shared.proto import common_pb2


@dataclass(frozen=True)
class WireLimits:
    """Cluster-wide request limits that travel with every wire slot map.

    Attributes:
        max_payload_bytes: most bytes of one memory's payload; workers size their stores
            with it and refuse larger payloads (INVALID_ARGUMENT).
        max_batch_items: most ids in one keyed memory request (upsert, get, delete,
            reinforce); clients split larger batches, workers refuse them.
        topk_max: largest k of a top-k request (the coordinator's ``topk_max``); workers
            refuse a larger k from a client's data-plane token (INVALID_ARGUMENT). 0: none
            published: workers refuse every client's top-k and clients ask the coordinator.
        max_sample_batch: most draws of one sample (the coordinator's ``max_sample_batch``);
            workers refuse more picks from a client's data-plane token. 0: as ``topk_max``.
    """

    max_payload_bytes: int
    max_batch_items: int
    topk_max: int = 0
    max_sample_batch: int = 0


@dataclass
class SlotMap:
    """Names per slot; "" means none. ``epoch`` grows with every published change."""

    epoch: int
    primary: list[str]
    replica: list[str]

    @classmethod
    def empty(cls, slots: int) -> SlotMap:
        """A map with no holder for any of ``slots`` slots, epoch 0."""
        return cls(0, [""] * slots, [""] * slots)

    @property
    def slots(self) -> int:
        """Number of hash slots."""
        return len(self.primary)

    def same_placement(self, other: SlotMap) -> bool:
        """True when both maps give every slot the same primary and replica."""
        return self.primary == other.primary and self.replica == other.replica

    def to_pb(
        self, addresses: Mapping[str, str], limits: WireLimits, *, placement: bool = True
    ) -> common_pb2.SlotMap:
        """The wire form of this map: the one conversion every published map goes through.

        Args:
            addresses: worker name -> ``host:port``; a name without one gets "".
            limits: the cluster's request limits, always carried (workers and clients obey
                them).
            placement: False for the cluster's shape only (slot count and limits; epoch 0, no
                workers), as a registration reply carries it before the worker has a role.

        Returns:
            ``common_pb2.SlotMap`` with the worker names sorted, ``primary``/``replica`` as
            [slots] int32 indices into them (-1: none).
        """
        pb = common_pb2.SlotMap(
            slots=self.slots,
            max_payload_bytes=limits.max_payload_bytes,
            max_batch_items=limits.max_batch_items,
            topk_max=limits.topk_max,
            max_sample_batch=limits.max_sample_batch,
        )
        if not placement:
            return pb
        names = sorted({n for n in self.primary + self.replica if n})
        index = {n: i for i, n in enumerate(names)}
        pb.epoch = self.epoch
        pb.workers.extend(names)
        pb.addresses.extend(addresses.get(n, "") for n in names)
        pb.primary.extend(index.get(n, -1) for n in self.primary)
        pb.replica.extend(index.get(n, -1) for n in self.replica)
        return pb

    def counts(self) -> dict[str, tuple[int, int]]:
        """(slots as primary, slots as replica) per worker name."""
        out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for p, r in zip(self.primary, self.replica, strict=True):
            if p:
                out[p][0] += 1
            if r:
                out[r][1] += 1
        return {n: (c[0], c[1]) for n, c in out.items()}

    def under_replicated(
        self,
        alive: set[str],
        rf: int,
        confirmed: set[str] | None = None,
        untrusted: dict[str, set[int]] | None = None,
    ) -> int:
        """Slots with fewer than ``rf`` live copies (rf capped by the live worker count).

        Args:
            alive: the ALIVE workers (they set how many copies are wanted).
            rf: the replication factor wanted.
            confirmed: the holders whose copies count (default ``alive``): a worker
                restored from the saved registry, or restarted and not yet verified, may be
                ALIVE while its copies are not yet served or decided.
            untrusted: worker -> slots whose copy on it does not count (being re-copied).
        """
        want = min(rf, len(alive))
        counted = alive if confirmed is None else confirmed & alive
        bad = untrusted or {}
        return sum(
            1
            for slot, (p, r) in enumerate(zip(self.primary, self.replica, strict=True))
            if sum(1 for h in (p, r) if h and h in counted and slot not in bad.get(h, ())) < want
        )


@dataclass
class Plan:
    """The move from one published map to the next (``plan``); epochs left to the caller.

    Attributes:
        interim: live data holders only, a dead primary's replica promoted.
        target: rendezvous placement over the live workers.
        copies: (source, destination) worker names -> slots to copy before the target.
        lost: slots left with their dead holders (``keep_lost``).
    """

    interim: SlotMap
    target: SlotMap
    copies: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    lost: list[int] = field(default_factory=list)

    @property
    def slots_to_copy(self) -> int:
        """Slot copies the plan makes, counting each destination."""
        return sum(len(v) for v in self.copies.values())


def plan(
    current: SlotMap,
    alive: list[str],
    no_data: set[str],
    draining: set[str] | None = None,
    *,
    untrusted: dict[str, set[int]] | None = None,
    keep_lost: bool = False,
) -> Plan:
    """Plan the move from ``current`` to rendezvous placement over ``alive`` workers.

    Args:
        current: the published map.
        alive: names of the live workers.
        no_data: live workers known to have lost their data (a restarted process); they
            keep no role in the interim map.
        draining: workers leaving: they keep their data roles in the interim map (they are
            copy sources) but get none in the target.
        untrusted: worker -> slots whose copy there is stale (a failed forward, a restart
            behind the other holder): like ``no_data``, per slot.
        keep_lost: a slot whose every trusted copy is on dead workers keeps those holders in
            both maps (no live worker can serve it without losing its data) instead of
            starting empty on live workers.

    Returns:
        The interim map (live data holders only, a dead primary's replica promoted), the
        target map, and the copies (source -> destination slots) that must finish before the
        target is published. Epochs are left to the caller.
    """
    S = current.slots
    live = (set(alive) | (draining or set())) - no_data
    bad = untrusted or {}
    interim = SlotMap(current.epoch, [""] * S, [""] * S)
    lost: list[int] = []
    for s in range(S):
        trusted = [
            h
            for h in (current.primary[s], current.replica[s])
            if h and h not in no_data and s not in bad.get(h, ())
        ]
        holders = [h for h in trusted if h in live]
        if not holders and keep_lost and trusted:
            holders = trusted
            lost.append(s)
        if holders:
            interim.primary[s] = holders[0]
            interim.replica[s] = holders[1] if len(holders) > 1 else ""
    names = sorted(alive)
    p_idx, r_idx = assign_slots(names, S)
    target = SlotMap(
        current.epoch,
        [names[i] if i >= 0 else "" for i in p_idx.tolist()],
        [names[i] if i >= 0 else "" for i in r_idx.tolist()],
    )
    for s in lost:
        target.primary[s], target.replica[s] = interim.primary[s], interim.replica[s]
    copies: dict[tuple[str, str], list[int]] = defaultdict(list)
    for s in range(S):
        src = interim.primary[s]
        if not src or src not in live:
            continue  # no live copy (or it never had data): start empty, or wait if lost
        for dst in (target.primary[s], target.replica[s]):
            if dst and dst not in (interim.primary[s], interim.replica[s]):
                copies[(src, dst)].append(s)
    return Plan(interim, target, dict(copies), lost)


def primary_changes(old: SlotMap, new: SlotMap) -> set[str]:
    """Workers that were primary of a slot whose primary changes (they are told first)."""
    return {o for o, n in zip(old.primary, new.primary, strict=True) if o and o != n}


def fence_moving_primaries(current: SlotMap, target: SlotMap) -> SlotMap | None:
    """The current map with no primary for slots whose primary changes in ``target``.

    Published (and acknowledged by every worker) before the target, so the old primary has
    finished its last write of such a slot before the new one accepts its first: two workers
    never act as primary of one slot at once. Holders keep their data meanwhile; clients
    retry the fenced slots for the instant it lasts. None when no primary moves.
    """
    moving = [
        s
        for s in range(current.slots)
        if current.primary[s] and target.primary[s] != current.primary[s]
    ]
    if not moving:
        return None
    fence = SlotMap(current.epoch, list(current.primary), list(current.replica))
    for s in moving:
        fence.primary[s] = ""
    return fence
