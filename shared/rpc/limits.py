"""Request limits enforced by the servers, and the client's splitting of batches to fit them.

- ``max_message_bytes`` (both daemons): gRPC refuses larger messages with RESOURCE_EXHAUSTED.
- ``max_concurrent_streams`` (both daemons): HTTP/2 ``SETTINGS_MAX_CONCURRENT_STREAMS``; a
  client connection's RPCs beyond it wait for a free stream (they are not refused).
- ``max_batch_items``: a worker refuses a keyed memory request (Upsert, Get, Delete,
  Reinforce) carrying more ids than its own value with INVALID_ARGUMENT; the coordinator
  publishes its value in the slot map (``GetSlotMap``) and ``MemoryRouter`` splits larger
  batches to it, so clients do not send one (keep both values equal).
- ``max_jobs_per_client`` (coordinator): checked by ``Cluster.submit`` (RESOURCE_EXHAUSTED).
- Replies and streams a daemon assembles or builds are bounded before they are allocated
  (``BudgetExceeded``): a Get reply by ``max_message_bytes``, a ``ReceiveSlots`` stream by
  ``max_receive_slots_bytes``, a ComputeGradients reply by the model's tensor shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from shared.rpc import Options

DEFAULT_MAX_BATCH_ITEMS = 1 << 20
DEFAULT_MAX_RECEIVE_SLOTS_BYTES = 2 << 30
MESSAGE_HEADROOM_BYTES = 64 * 1024  # a keyed request's fields besides its per-item arrays


class BudgetExceeded(ValueError):
    """A reply or a stream would exceed a byte limit; nothing was allocated for the rest of it.

    Maps to RESOURCE_EXHAUSTED; the message names the limit (a config key, or the tensor).
    """


KEYED_METHODS = {"/neuroshard.v1.Worker/" + m for m in ("Upsert", "Get", "Delete", "Reinforce")}


def server_options(max_message_bytes: int, max_concurrent_streams: int) -> Options:
    """Return a daemon's ``grpc.aio.server`` options.

    Args:
        max_message_bytes: the largest message received or sent, bytes; larger ones are
            RESOURCE_EXHAUSTED.
        max_concurrent_streams: concurrent RPCs per client connection; more wait for a
            free stream.
    """
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_concurrent_streams", max_concurrent_streams),
    ]


def batch_error(items: int, limit: int, field: str = "ids") -> str | None:
    """Say why a batch is refused, or return None when it is within the limit.

    Args:
        items: ids in the request.
        limit: the receiving worker's ``max_batch_items``.
        field: the request field, named in the message.
    """
    if items <= limit:
        return None
    return (
        f"{field}: {items} items exceed max_batch_items {limit}; "
        "split the batch (the Python client does)"
    )


def request_items(max_batch_items: int, max_message_bytes: int, item_bytes: int) -> int:
    """Most items one keyed request may carry, >= 1.

    At most ``max_batch_items`` (what a worker takes; 0: no such cap), and few enough that
    ``item_bytes`` per item fit in ``max_message_bytes`` with ``MESSAGE_HEADROOM_BYTES`` to
    spare.

    Args:
        max_batch_items: the cluster's ``max_batch_items`` (the slot map's), 0 for none.
        max_message_bytes: the channel's message limit, bytes.
        item_bytes: bytes of one item's fixed-size fields (an upsert's id and strength: 12).
    """
    by_bytes = (max_message_bytes - MESSAGE_HEADROOM_BYTES) // item_bytes
    return max(1, min(max_batch_items or by_bytes, by_bytes))


def split_parts(
    owners: npt.NDArray[np.int64],
    parts: list[npt.NDArray[np.int64]],
    limit: int,
    slots_of: Callable[[npt.NDArray[np.int64]], npt.NDArray[np.integer]],
) -> tuple[npt.NDArray[np.int64], list[npt.NDArray[np.int64]]]:
    """Cut each owner's part of a routed batch into requests of at most ``limit`` items.

    Cuts fall on slot boundaries: every slot's items stay in one request, so the pieces can
    share the batch's request id (workers deduplicate retries per request id and slot).

    Args:
        owners: [G] int64 worker index of each part.
        parts: G arrays of [n_g] int64 batch positions.
        limit: most items per request (the cluster's ``max_batch_items``).
        slots_of: maps [n] int64 batch positions to their [n] integer slots.

    Returns:
        ([G'] int64 owners, G' arrays of positions), G' >= G. A slot holding more than
        ``limit`` items of the batch stays whole (the worker then refuses it).
    """
    import numpy as np

    if all(len(p) <= limit for p in parts):
        return owners, parts
    out_owners: list[int] = []
    out_parts: list[npt.NDArray[np.int64]] = []
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
