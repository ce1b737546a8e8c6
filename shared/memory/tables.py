"""Replay tables: named, independent sets of memories, and the checks of their specs.

Every keyed and bulk memory operation names a table (empty: ``DEFAULT_TABLE``); ids are per
table. The coordinator keeps the tables (``coordinator/memory/tables.py``) and publishes them
in the slot map (``SlotMap.tables``); workers hold one set of slot rows per table
(``worker/store/store.py``). See docs/architecture.md "Tables".
"""

from __future__ import annotations

import math
import re

from shared.memory.validation import MemoryInputError
from shared.proto import common_pb2

__all__ = [
    "DEFAULT_TABLE",
    "EVICTIONS",
    "NO_FORGET",
    "TableNotFound",
    "default_spec",
    "table_name",
    "table_specs",
    "validate_table_name",
    "validate_table_spec",
]

DEFAULT_TABLE = "default"
EVICTIONS = ("fifo", "weakest")
NO_FORGET = -1.0  # forget_below of a table that forgets nothing
MAX_TABLE_NAME = 64
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]*\Z")


class TableNotFound(LookupError):
    """A request names a table the cluster does not have (NOT_FOUND)."""


def table_name(name: str) -> str:
    """Return the table a request names: ``name``, or ``DEFAULT_TABLE`` when empty."""
    return name or DEFAULT_TABLE


def validate_table_name(name: str, field: str = "name") -> str:
    """Return a table name that is well formed.

    Raises:
        MemoryInputError: empty, over 64 characters, or other than ``[a-z0-9][a-z0-9_-]*``
            (INVALID_ARGUMENT).
    """
    if not name or len(name) > MAX_TABLE_NAME or not _NAME.match(name):
        raise MemoryInputError(
            f"{field}: {name!r} is not a table name ([a-z0-9][a-z0-9_-]*, at most "
            f"{MAX_TABLE_NAME} characters)"
        )
    return name


def validate_table_spec(
    name: str,
    capacity: int,
    eviction: str,
    max_payload_bytes: int,
    forget_below: float | None,
    cluster_max_payload_bytes: int,
) -> common_pb2.TableSpec:
    """Check the parameters of a new table; return its spec (``id`` 0: given by the caller).

    Args:
        name: the table's name (not "default").
        capacity: most memories held, >= 0 (0: unlimited).
        eviction: "fifo" or "weakest" ("" means "fifo").
        max_payload_bytes: largest payload, bytes, 0 < it <= ``cluster_max_payload_bytes``;
            0 means the cluster's.
        forget_below: None (never), or a strength in [0, 1): a decay removes memories left
            at or below it.
        cluster_max_payload_bytes: the cluster's limit, bytes.

    Raises:
        MemoryInputError: a parameter out of range, naming the field (INVALID_ARGUMENT).
    """
    validate_table_name(name)
    if name == DEFAULT_TABLE:
        raise MemoryInputError(f"name: {DEFAULT_TABLE!r} is reserved (it always exists)")
    if capacity < 0:
        raise MemoryInputError(f"capacity: {capacity} must be >= 0 (0: unlimited)")
    eviction = eviction or "fifo"
    if eviction not in EVICTIONS:
        raise MemoryInputError(f"eviction: {eviction!r} is not one of {', '.join(EVICTIONS)}")
    limit = max_payload_bytes or cluster_max_payload_bytes
    if not 0 < limit <= cluster_max_payload_bytes:
        raise MemoryInputError(
            f"max_payload_bytes: {max_payload_bytes} must be in 1..{cluster_max_payload_bytes} "
            "(the cluster's max_payload_bytes)"
        )
    forget = NO_FORGET
    if forget_below is not None:
        if not math.isfinite(forget_below) or not 0 <= forget_below < 1:
            raise MemoryInputError(f"forget_below: {forget_below} must be in [0, 1)")
        forget = float(forget_below)
    return common_pb2.TableSpec(
        name=name,
        capacity=capacity,
        eviction=eviction,
        max_payload_bytes=limit,
        forget_below=forget,
    )


def default_spec(max_payload_bytes: int) -> common_pb2.TableSpec:
    """The spec of the default table: unlimited, the cluster's payload limit, no forgetting."""
    return common_pb2.TableSpec(
        name=DEFAULT_TABLE,
        capacity=0,
        eviction="fifo",
        max_payload_bytes=max_payload_bytes,
        forget_below=NO_FORGET,
    )


def table_specs(m: common_pb2.SlotMap) -> dict[str, common_pb2.TableSpec]:
    """Return every table of a slot map by name, the default one included."""
    specs = {DEFAULT_TABLE: default_spec(m.max_payload_bytes)}
    specs.update((t.name, t) for t in m.tables)
    return specs
