"""The cluster's replay tables: create, list and drop, persisted, published in the slot map.

A table's spec (``shared/memory/tables.py``) travels to every worker and client in the slot
map (its ``tables`` field): a create or a drop publishes a new map (same placement, next
epoch) under the rebalancer's ``map_lock``, so a worker learns of a table with the map that
lists it and every keyed request routed with an older map is refused as stale. Each table
takes an incarnation id never used before (a dropped and re-created name is another table to
the workers). See docs/architecture.md "Tables".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from coordinator.placement.rebalance import Rebalancer
from shared.memory.tables import (
    DEFAULT_TABLE,
    TableNotFound,
    default_spec,
    validate_table_name,
    validate_table_spec,
)
from shared.memory.validation import MemoryInputError
from shared.proto import common_pb2

__all__ = ["TableExists", "Tables"]

# Saves the tables' document (``Tables.to_doc``) durably before a change is published.
Persist = Callable[[dict[str, Any]], None]
# Insert stamps are reserved (and saved) this many at a time: a restarted coordinator goes on
# from the reserved mark, so stamps only grow, at one save per block.
STAMP_BLOCK = 1 << 20


class TableExists(Exception):
    """CreateTable of a name that is taken (ALREADY_EXISTS)."""


class Tables:
    """The table specs of the cluster, their persistence and their publication."""

    def __init__(
        self, rebalancer: Rebalancer, max_payload_bytes: int, persist: Persist | None = None
    ) -> None:
        """Keep no table but the default one; publish through ``rebalancer``.

        Args:
            rebalancer: owner of the slot map (its ``tables`` source is set to this).
            max_payload_bytes: the cluster's payload limit, bytes (a table's is at most it).
            persist: saves ``to_doc()`` before a change is published; None: nothing kept.
        """
        self._rebalancer = rebalancer
        self._max_payload_bytes = max_payload_bytes
        self.persist = persist
        self._specs: dict[str, common_pb2.TableSpec] = {}
        self._next_id = 1
        # A capped table's next insert stamp and the end of the block reserved on disk.
        self._stamps: dict[str, tuple[int, int]] = {}
        rebalancer.tables = self.specs

    def specs(self) -> list[common_pb2.TableSpec]:
        """Return the tables other than the default one, by name (what the slot map lists)."""
        return [self._specs[n] for n in sorted(self._specs)]

    def list(self) -> list[common_pb2.TableSpec]:
        """Return every table, the default one first, then by name."""
        return [default_spec(self._max_payload_bytes), *self.specs()]

    def load_doc(self, doc: dict[str, Any]) -> None:
        """Restore the tables saved by ``to_doc`` (a restarted coordinator)."""
        self._next_id = int(doc.get("next_id", 1))
        self._specs = {}
        reserved = doc.get("stamps_reserved", {})
        self._stamps = {n: (int(v), int(v)) for n, v in reserved.items()}
        for t in doc.get("tables", []):
            spec = common_pb2.TableSpec(
                name=t["name"],
                id=int(t["id"]),
                capacity=int(t["capacity"]),
                eviction=t["eviction"],
                max_payload_bytes=int(t["max_payload_bytes"]),
                forget_below=float(t["forget_below"]),
            )
            self._specs[spec.name] = spec

    def to_doc(self) -> dict[str, Any]:
        """Return the tables as a JSON-able document (``load_doc`` reads it back)."""
        tables = [
            {
                "name": s.name,
                "id": s.id,
                "capacity": s.capacity,
                "eviction": s.eviction,
                "max_payload_bytes": s.max_payload_bytes,
                "forget_below": s.forget_below,
            }
            for s in self.specs()
        ]
        reserved = {n: end for n, (_, end) in self._stamps.items() if n in self._specs}
        return {"next_id": self._next_id, "tables": tables, "stamps_reserved": reserved}

    async def create(
        self,
        name: str,
        capacity: int = 0,
        eviction: str = "fifo",
        max_payload_bytes: int = 0,
        forget_below: float | None = None,
    ) -> common_pb2.TableSpec:
        """Create a table; return its spec once the map listing it is published.

        Args:
            name: ``[a-z0-9][a-z0-9_-]*``, at most 64 characters, not "default".
            capacity: most memories, >= 0 (0: unlimited).
            eviction: "fifo" or "weakest".
            max_payload_bytes: largest payload, bytes (0: the cluster's).
            forget_below: None, or in [0, 1).

        Raises:
            MemoryInputError: a parameter out of range, naming the field (INVALID_ARGUMENT).
            TableExists: the name is taken (ALREADY_EXISTS).
        """
        spec = validate_table_spec(
            name, capacity, eviction, max_payload_bytes, forget_below, self._max_payload_bytes
        )
        async with self._rebalancer.map_lock:
            if name in self._specs:
                raise TableExists(f"table {name!r} exists already")
            spec.id = self._next_id
            self._next_id += 1
            self._specs[name] = spec
            self._save()
            await self._rebalancer.publish_same()
        return spec

    async def drop(self, name: str) -> None:
        """Drop a table and every memory of it; return once the map without it is published.

        Raises:
            MemoryInputError: "default" (INVALID_ARGUMENT).
            TableNotFound: no such table (NOT_FOUND).
        """
        validate_table_name(name)
        if name == DEFAULT_TABLE:
            raise MemoryInputError(f"name: the {DEFAULT_TABLE!r} table cannot be dropped")
        async with self._rebalancer.map_lock:
            if name not in self._specs:
                raise TableNotFound(f"table {name!r} does not exist")
            del self._specs[name]
            self._stamps.pop(name, None)
            self._save()
            await self._rebalancer.publish_same()

    def spec(self, name: str) -> common_pb2.TableSpec:
        """Return a table's spec (the default one's too).

        Raises:
            TableNotFound: no such table (NOT_FOUND).
        """
        if not name or name == DEFAULT_TABLE:
            return default_spec(self._max_payload_bytes)
        spec = self._specs.get(name)
        if spec is None:
            raise TableNotFound(f"table {name!r} does not exist")
        return spec

    def take_stamps(self, name: str, n: int) -> np.ndarray:
        """Return the next n insert stamps [n] uint64 of a table (>= 1, never given before).

        A block of ``STAMP_BLOCK`` is saved before its first stamp is given.
        """
        start, end = self._stamps.get(name, (1, 1))
        if start + n > end:
            end = start + n + STAMP_BLOCK
            self._stamps[name] = (start, end)
            self._save()
        self._stamps[name] = (start + n, end)
        return np.arange(start, start + n, dtype=np.uint64)

    def check(self, name: str) -> str:
        """Return the table a bulk request names (empty: the default one).

        Raises:
            TableNotFound: no such table (NOT_FOUND).
        """
        if not name or name == DEFAULT_TABLE:
            return DEFAULT_TABLE
        if name not in self._specs:
            raise TableNotFound(f"table {name!r} does not exist")
        return name

    def _save(self) -> None:
        if self.persist is not None:
            self.persist(self.to_doc())
