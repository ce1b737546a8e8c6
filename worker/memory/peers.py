"""What a worker sends to its peers: a primary's forwards and slot copies.

``Replicate`` and ``ReceiveSlots`` calls over the shared per-worker channels of
``WorkerClients``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from grpc import aio

from shared.proto import worker_pb2
from shared.rpc import error_message
from shared.rpc.peers import WorkerClients
from worker.memory.replication import ReplicationError
from worker.memory.wire import slot_messages
from worker.store.store import SlotSnapshot

__all__ = ["PeerLinks"]


class PeerLinks:
    """Calls to peer workers, each with a deadline."""

    def __init__(self, clients: WorkerClients, chunk_bytes: int, rpc_timeout_s: float) -> None:
        """Send over ``clients``' channels.

        Args:
            clients: channels and stubs to workers by name.
            chunk_bytes: target size of one ``SlotData`` message of a copy, bytes.
            rpc_timeout_s: deadline of each call, seconds.
        """
        self._clients = clients
        self._chunk_bytes = chunk_bytes
        self._timeout_s = rpc_timeout_s

    async def forward(self, target: str, address: str, req: worker_pb2.ReplicateRequest) -> None:
        """Send one replicated op to worker ``target`` at ``address`` (a ``Forwarder``).

        Raises:
            grpc.aio.AioRpcError: the peer refused it or could not be reached.
        """
        await self._clients.stub(target, address).Replicate(req, timeout=self._timeout_s)

    async def send_slots(
        self, target: str, address: str, snaps: list[SlotSnapshot]
    ) -> tuple[int, int]:
        """Stream slot snapshots to worker ``target``'s ReceiveSlots (a ``SlotSender``).

        Returns:
            (memories, bytes of the messages) sent.

        Raises:
            ReplicationError: the peer refused the copy or could not be reached (UNAVAILABLE).
        """
        msgs = [m for snap in snaps for m in slot_messages(snap, self._chunk_bytes)]

        async def stream() -> AsyncIterator[worker_pb2.SlotData]:
            for m in msgs:
                yield m

        try:
            stub = self._clients.stub(target, address)
            await stub.ReceiveSlots(stream(), timeout=self._timeout_s)
        except aio.AioRpcError as exc:
            raise ReplicationError(
                f"copying slots to {target} at {address} failed: {error_message(exc)}"
            ) from None
        return sum(len(s.ids) for s in snaps), sum(m.ByteSize() for m in msgs)
