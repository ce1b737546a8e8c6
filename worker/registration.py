"""Registration with the coordinator and the heartbeat loop.

The worker registers at start, heartbeats every ``heartbeat_interval_s`` (the coordinator's
value), and registers again whenever the coordinator does not know it (a restarted
coordinator) or was unreachable.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Callable

from grpc import aio

from shared.logging import get_logger
from shared.proto import coordinator_pb2, coordinator_pb2_grpc

log = get_logger(__name__)


class RegistrationRefused(Exception):
    """This worker cannot join the coordinator's cluster (FAILED_PRECONDITION).

    E.g. its data dir holds another slot count; raised by ``on_register``, it ends the
    registration loop.
    """


class Registration:
    """Keeps this worker registered and heartbeating."""

    def __init__(
        self,
        stub: coordinator_pb2_grpc.CoordinatorStub,
        name: str,
        address: str,
        device: str,
        memories: Callable[[], int],
        rpc_timeout_s: float,
        on_register: Callable[[coordinator_pb2.RegisterWorkerResponse], None] | None = None,
        epoch: Callable[[], int] = lambda: 0,
        train_device: str = "cpu",
        held_memories: Callable[[], tuple[list[int], list[int]]] = lambda: ([], []),
    ) -> None:
        """Prepare the registration (``run`` does it).

        Args:
            stub: the coordinator's stub.
            name: this worker's name.
            address: the address peers and the coordinator reach this worker at.
            device: the memory kernels' device, "cpu" or "cuda", as reported.
            memories: memories held as primary, reported in each heartbeat.
            rpc_timeout_s: deadline of a registration call, seconds.
            on_register: called with each registration reply (may raise
                ``RegistrationRefused``, which ends ``run``).
            epoch: the slot-map epoch this worker is at, reported in each heartbeat.
            train_device: where this worker trains models, "cpu" or "cuda:N", as reported.
            held_memories: (slots, memories of each) held here, reported in each heartbeat.
        """
        self._on_register = on_register
        self.incarnation = uuid.uuid4().hex
        self.epoch = epoch
        self._stub, self.name, self.address, self.device = stub, name, address, device
        self.train_device = train_device
        self._memories = memories
        self._held_memories = held_memories
        self._timeout_s = rpc_timeout_s
        self.interval_s = 0.5
        self.registered = asyncio.Event()

    async def register(self) -> None:
        """Register once. Raises: grpc.aio.AioRpcError when the coordinator refuses or is down."""
        reply = await self._stub.RegisterWorker(
            coordinator_pb2.RegisterWorkerRequest(
                name=self.name,
                address=self.address,
                device=self.device,
                incarnation=self.incarnation,
                train_device=self.train_device,
            ),
            timeout=self._timeout_s,
        )
        self.interval_s = reply.heartbeat_interval_s or self.interval_s
        if self._on_register is not None:
            self._on_register(reply)
        self.registered.set()
        log.info(
            "worker_registered",
            worker=self.name,
            address=self.address,
            heartbeat_interval_s=self.interval_s,
        )

    async def run(self) -> None:
        """Register (retrying with jittered backoff), then heartbeat forever."""
        backoff_s = 0.1
        while True:
            try:
                if not self.registered.is_set():
                    await self.register()
                held_slots, held_memories = self._held_memories()
                reply = await self._stub.Heartbeat(
                    coordinator_pb2.HeartbeatRequest(
                        name=self.name,
                        memories=self._memories(),
                        slot_map_epoch=self.epoch(),
                        held_slots=held_slots,
                        held_memories=held_memories,
                    ),
                    timeout=max(self.interval_s * 2, 1.0),
                )
                if not reply.registered:
                    log.warning("coordinator_forgot_worker", worker=self.name)
                    self.registered.clear()
                    continue
                backoff_s = 0.1
                await asyncio.sleep(self.interval_s)
            except (asyncio.CancelledError, RegistrationRefused):
                raise
            except Exception as exc:  # keep the worker registered whatever went wrong
                code = exc.code().name if isinstance(exc, aio.AioRpcError) else type(exc).__name__
                if code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):  # retrying cannot help
                    details = exc.details() if isinstance(exc, aio.AioRpcError) else ""
                    raise RegistrationRefused(
                        f"the coordinator refused its token: {details}"
                    ) from None
                if self.registered.is_set():
                    log.warning("heartbeat_failed", code=code, details=str(exc)[:200])
                self.registered.clear()
                await asyncio.sleep(backoff_s * random.uniform(0.5, 1.5))
                backoff_s = min(backoff_s * 2, 2.0)
