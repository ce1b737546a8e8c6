"""Two ``MemoryNode``s, 'p' and 'r', wired to each other in one process (no gRPC)."""

from __future__ import annotations

from shared.proto import common_pb2, worker_pb2
from worker.memory.memory_node import MemoryNode


class Wire:
    """Delivers forwards to the named nodes' ``apply_replicated``; counts them."""

    def __init__(self) -> None:
        self.nodes: dict[str, MemoryNode] = {}
        self.forwards: list[worker_pb2.ReplicateRequest] = []

    async def forward(self, target: str, address: str, req: worker_pb2.ReplicateRequest) -> None:
        self.forwards.append(req)
        await self.nodes[target].apply_replicated(req)

    async def report(self, target: str, slots: list[int], reason: str) -> None:
        raise AssertionError(f"unexpected report {target} {slots} {reason}")


def pair_map(slots: int, epoch: int = 1, primary: int = 0) -> common_pb2.SlotMap:
    """Worker ``primary`` (0: 'p', 1: 'r') holds every slot's primary, the other its replica."""
    return common_pb2.SlotMap(
        epoch=epoch,
        slots=slots,
        workers=["p", "r"],
        addresses=["p:1", "r:1"],
        primary=[primary] * slots,
        replica=[1 - primary] * slots,
    )
