"""This worker's ``MemoryNode`` before and after it exists.

A worker learns the cluster's slot count from the coordinator (the registration reply or the
first pushed slot map, whichever comes first), so its memory node is made then, unless one
was reloaded from the data dir at start. The memory servicer asks the holder for the node on
every call; until there is one, memory RPCs answer UNAVAILABLE (``NotReady``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from shared.proto import common_pb2
from worker.memory.memory_node import MemoryNode
from worker.registration import RegistrationRefused

__all__ = ["NodeHolder", "NotReady"]

DEFAULT_SLOTS = 1024  # a map that names no slot count (older coordinators) means the default

# Makes the node for a slot map's slot count and payload limit (bytes per memory).
NodeFactory = Callable[[int, int], MemoryNode]


class NotReady(Exception):
    """The worker has not registered yet, so it has no slot map (UNAVAILABLE)."""


class NodeHolder:
    """Holds this worker's memory node once there is one."""

    def __init__(self, make: NodeFactory, data_dir: Path, coordinator: str) -> None:
        """Hold no node yet.

        Args:
            make: builds the node when the first slot map arrives (see ``NodeFactory``).
            data_dir: this worker's data dir.
            coordinator: the coordinator's address (both named in the error when a reloaded
                node has another slot count than the cluster).
        """
        self._make = make
        self._data_dir = data_dir
        self._coordinator = coordinator
        self._node: MemoryNode | None = None

    @property
    def current(self) -> MemoryNode | None:
        """The node, or None before the worker knows the cluster's slot count."""
        return self._node

    def get(self) -> MemoryNode:
        """Return the node.

        Raises:
            NotReady: there is none yet (UNAVAILABLE).
        """
        if self._node is None:
            raise NotReady("this worker has not registered with the coordinator yet")
        return self._node

    def install(self, node: MemoryNode) -> None:
        """Hold a node reloaded from the data dir (at start, before serving)."""
        self._node = node

    def ensure(self, slot_map: common_pb2.SlotMap) -> MemoryNode:
        """Return the node, making it from the first slot map that arrives.

        A later map's payload limit is adopted.

        Raises:
            RegistrationRefused: the node holds another slot count than the cluster's
                (FAILED_PRECONDITION).
        """
        node = self._node
        if node is None:
            node = self._node = self._make(
                slot_map.slots or DEFAULT_SLOTS, slot_map.max_payload_bytes
            )
        elif slot_map.slots and slot_map.slots != node.num_slots:
            raise RegistrationRefused(
                f"data_dir {self._data_dir} holds {node.num_slots} slots but the coordinator "
                f"at {self._coordinator} has {slot_map.slots}; use another data_dir"
            )
        elif slot_map.max_payload_bytes:
            node.set_max_payload_bytes(slot_map.max_payload_bytes)
        return node
