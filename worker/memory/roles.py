"""The slot map as one worker sees it.

Which slots it is primary or replica of, who the replica of each slot is, and the epoch and
primary checks of every data-plane request.

Shape letters: S slots of the cluster, N ids of a request, K slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared.memory.slots import slot_of
from shared.memory.validation import as_slots
from shared.proto import common_pb2

__all__ = ["NotPrimary", "Placement", "Roles", "StaleEpoch"]


@dataclass(frozen=True)
class Roles:
    """This worker's roles at one slot-map epoch.

    Attributes:
        epoch: the slot map's epoch (0 before the first map).
        primary: [S] bool, slots this worker is the primary of.
        replica: [S] bool, slots this worker is the replica of.
        replica_of: [S] name of each slot's replica ("" when it has none).
        addresses: worker name -> address, for every worker of the map.
    """

    epoch: int
    primary: np.ndarray
    replica: np.ndarray
    replica_of: list[str]
    addresses: dict[str, str]

    @classmethod
    def none(cls, num_slots: int) -> Roles:
        """Return the roles before any map: epoch 0, no slot held.

        Args:
            num_slots: S.
        """
        no = np.zeros(num_slots, bool)
        return cls(0, no, no.copy(), [""] * num_slots, {})

    @classmethod
    def from_map(cls, m: common_pb2.SlotMap, name: str) -> Roles:
        """Return worker ``name``'s roles in a (validated) slot map.

        Args:
            m: the slot map; ``primary``/``replica`` are [S] indices into ``workers``, -1 for
                none.
            name: this worker's name (a worker not in the map holds no slot).
        """
        names = list(m.workers)
        me = names.index(name) if name in names else -2  # -2 matches no index, not even -1
        return cls(
            epoch=int(m.epoch),
            primary=np.asarray(m.primary, np.int64) == me,
            replica=np.asarray(m.replica, np.int64) == me,
            replica_of=[names[r] if r >= 0 else "" for r in m.replica],
            addresses=dict(zip(m.workers, m.addresses, strict=True)),
        )

    def holds(self, slots: np.ndarray) -> np.ndarray:
        """Return [K] bool: which of ``slots`` ([K] int64) this worker is primary or replica of."""
        held: np.ndarray = self.primary[slots] | self.replica[slots]
        return held

    def replica_slots_of(self, target: str) -> set[int]:
        """Return the slots this worker is primary of whose replica is worker ``target``."""
        return {s for s in np.flatnonzero(self.primary).tolist() if self.replica_of[s] == target}


class StaleEpoch(Exception):
    """The request was routed with another slot-map epoch (FAILED_PRECONDITION)."""


class NotPrimary(Exception):
    """An id's slot is not primary here at this epoch (FAILED_PRECONDITION)."""


class Placement:
    """Where this worker stands in the slot map over time.

    Its current ``Roles``, the slots it received copies of for a map still to come, and
    reloaded data kept until the first map.
    """

    def __init__(self, name: str, held: np.ndarray) -> None:
        """Start at epoch 0, holding no slot.

        Args:
            name: this worker's name, as in the slot map.
            held: [S] bool, slots with data or a history in the store at start (reloaded data is
                kept until the first map says which slots this worker holds: the coordinator
                sends it only once it has compared them with the other holders').
        """
        self.name = name
        self.roles = Roles.none(len(held))
        self._reloaded: np.ndarray | None = held.copy()
        # [S] bool: slots whose copy was received for a map not adopted yet (no role here
        # yet); their primary's forwards are applied even when they come from an older epoch.
        self.incoming = np.zeros(len(held), bool)

    def adopt(self, m: common_pb2.SlotMap, held: np.ndarray) -> np.ndarray:
        """Take a newer map's roles; return [K] int64 the held slots whose data must go.

        Data goes when this worker had a role for its slot and loses it, unless the map fences
        the slot (no primary for a moment). Data of slots it had no role for is kept: it may
        be a copy received for the map the coordinator is about to publish.

        Args:
            m: a validated map with an epoch above ``roles.epoch``.
            held: [S] bool, slots with data or a history in the store.
        """
        had_role = self.roles.primary | self.roles.replica
        if self._reloaded is not None:
            had_role, self._reloaded = had_role | self._reloaded, None
        roles = self.roles = Roles.from_map(m, self.name)
        self.incoming &= ~(roles.primary | roles.replica)
        fenced = np.asarray(m.primary, np.int64) < 0
        slots = np.flatnonzero(held)
        gone: np.ndarray = slots[had_role[slots] & ~roles.holds(slots) & ~fenced[slots]]
        self.incoming[gone] = False
        return gone

    def received(self, slots: list[int]) -> None:
        """Note copies of ``slots`` installed here (for a map not adopted yet)."""
        self.incoming[slots] = True
        if self._reloaded is not None:
            self._reloaded[slots] = False

    def check_epoch(self, epoch: int) -> None:
        """Raises: StaleEpoch when ``epoch`` is not this worker's epoch (FAILED_PRECONDITION)."""
        if epoch != self.roles.epoch:
            newer = "newer" if epoch < self.roles.epoch else "older"
            raise StaleEpoch(
                f"slot map epoch {epoch} does not match this worker's epoch "
                f"{self.roles.epoch} ({newer} map here); refresh the slot map and retry"
            )

    def check_primary_slots(self, slots: np.ndarray) -> None:
        """Check that every one of slots [K] int64 is primary here.

        Raises:
            NotPrimary: one is not (FAILED_PRECONDITION).
            MemoryInputError: a slot out of range (INVALID_ARGUMENT).
        """
        chosen = as_slots(slots, len(self.incoming))
        wrong = np.flatnonzero(~self.roles.primary[chosen])
        if len(wrong):
            raise NotPrimary(
                f"slot {chosen[int(wrong[0])]} is not primary on worker {self.name} at epoch "
                f"{self.roles.epoch}"
            )

    def check_primary(self, ids: np.ndarray) -> np.ndarray:
        """Return [N] int64 the slot of each of ``ids`` ([N] uint64).

        Raises:
            NotPrimary: an id's slot is not primary here (FAILED_PRECONDITION).
        """
        slots = slot_of(ids, len(self.incoming))
        wrong = np.flatnonzero(~self.roles.primary[slots])
        if len(wrong):
            i = int(wrong[0])
            raise NotPrimary(
                f"ids[{i}] ({ids[i]}) is in slot {slots[i]}, which is not primary on worker "
                f"{self.name} at epoch {self.roles.epoch}"
            )
        return slots
