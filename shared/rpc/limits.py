"""Request limits enforced by the servers.

- ``max_message_bytes`` (both daemons): gRPC refuses larger messages with RESOURCE_EXHAUSTED.
- ``max_concurrent_streams`` (both daemons): HTTP/2 ``SETTINGS_MAX_CONCURRENT_STREAMS``; a
  client connection's RPCs beyond it wait for a free stream (they are not refused).
- ``max_batch_items``: a worker refuses a keyed memory request (Upsert, Get, Delete,
  Reinforce) carrying more ids than its own value with INVALID_ARGUMENT; the coordinator
  publishes its value in the slot map (``GetSlotMap``) and ``MemoryRouter`` splits larger
  batches to it, so clients do not send one (keep both values equal).
- ``max_jobs_per_client`` (coordinator): checked by ``Cluster.submit`` (RESOURCE_EXHAUSTED).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

DEFAULT_MAX_BATCH_ITEMS = 1 << 20
KEYED_METHODS = {"/neuroshard.v1.Worker/" + m for m in ("Upsert", "Get", "Delete", "Reinforce")}


def server_options(max_message_bytes: int, max_concurrent_streams: int) -> list[tuple[str, Any]]:
    """``aio.server`` options: message size limits and concurrent streams per connection."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_concurrent_streams", max_concurrent_streams),
    ]


def batch_error(items: int, limit: int, field: str = "ids") -> str | None:
    """The refusal message for a batch of ``items`` over ``limit`` (None when within it)."""
    if items <= limit:
        return None
    return (
        f"{field}: {items} items exceed max_batch_items {limit}; "
        "split the batch (the Python client does)"
    )


def split(positions: Any, limit: int) -> list[Any]:
    """``positions`` ([n] array) in consecutive pieces of at most ``limit`` (0: no limit)."""
    if not limit or len(positions) <= limit:
        return [positions]
    return [positions[i : i + limit] for i in range(0, len(positions), limit)]


def split_parts(
    owners: Any, parts: list[Any], limit: int, slots_of: Callable[[Any], Any]
) -> tuple[Any, list[Any]]:
    """Cut each owner's part of a routed batch into requests of at most ``limit`` items,
    along slot boundaries: every slot's items stay in one request, so the pieces can share
    the batch's request id (workers deduplicate retries per request id and slot).

    Args:
        owners: [G] int64 worker index of each part.
        parts: G arrays of batch positions.
        limit: most items per request (the cluster's ``max_batch_items``).
        slots_of: positions [n] -> their slots [n].

    Returns:
        ([G'] int64 owners, G' arrays of positions), G' >= G. A slot holding more than
        ``limit`` items of the batch stays whole (the worker then refuses it).
    """
    import numpy as np

    if all(len(p) <= limit for p in parts):
        return owners, parts
    out_owners: list[int] = []
    out_parts: list[Any] = []
    for w, part in zip(owners.tolist(), parts, strict=True):
        if len(part) <= limit:
            out_owners.append(w)
            out_parts.append(part)
            continue
        slots = slots_of(part)
        order = np.argsort(slots, kind="stable")  # batch order kept within each slot
        sorted_slots = np.asarray(slots)[order].astype(np.int64)
        starts = np.flatnonzero(np.diff(sorted_slots, prepend=-1)).tolist()
        begin = 0
        for a, b in zip(starts, [*starts[1:], len(part)], strict=True):  # slot group [a, b)
            if b - begin > limit and a > begin:  # the group does not fit: close the piece
                out_owners.append(w)
                out_parts.append(part[order[begin:a]])
                begin = a
        out_owners.append(w)
        out_parts.append(part[order[begin:]])
    return np.array(out_owners, np.int64), out_parts
