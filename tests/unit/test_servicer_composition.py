"""Each daemon's registered servicer serves every RPC of its proto service, each the way
grpc.aio needs it: a coroutine function for a unary reply, an async generator function for a
streamed one (a coroutine returning an iterator is not streamed). The parts an RPC is handed
to (``DataServicer``, ``MemoryServicer``, ...) define it in the same form."""

from __future__ import annotations

import inspect
from types import ModuleType

import pytest

from coordinator.coordinator_servicer import CoordinatorServicer
from coordinator.data_servicer import DataServicer
from shared.proto import coordinator_pb2, coordinator_pb2_grpc, worker_pb2, worker_pb2_grpc
from worker.allreduce.allreduce_servicer import AllreduceServicer
from worker.memory.memory_servicer import MemoryServicer
from worker.training.training_servicer import TrainingServicer
from worker.worker_servicer import WorkerServicer

SERVICES = [
    (coordinator_pb2, "Coordinator", CoordinatorServicer, coordinator_pb2_grpc.CoordinatorServicer),
    (worker_pb2, "Worker", WorkerServicer, worker_pb2_grpc.WorkerServicer),
]
PARTS = [DataServicer, MemoryServicer, TrainingServicer, AllreduceServicer]


def rpcs(module: ModuleType, service: str) -> list[tuple[str, bool]]:
    """(method name, server streaming) of each RPC of ``service``."""
    desc = module.DESCRIPTOR.services_by_name[service]
    return [(m.name, m.server_streaming) for m in desc.methods]


def form(function: object) -> str:
    if inspect.isasyncgenfunction(function):
        return "async generator"
    if inspect.iscoroutinefunction(function):
        return "coroutine"
    return "other"


@pytest.mark.parametrize(("module", "service", "servicer", "base"), SERVICES)
def test_every_rpc_is_served_in_the_form_grpc_aio_needs(module, service, servicer, base) -> None:
    for name, streaming in rpcs(module, service):
        method = getattr(servicer, name)

        assert method is not getattr(base, name), f"{service}.{name} is not served"
        assert form(method) == ("async generator" if streaming else "coroutine"), name


def test_the_parts_define_their_rpcs_in_the_same_form() -> None:
    streaming = {name: s for module, service, _, _ in SERVICES for name, s in rpcs(module, service)}
    for part in PARTS:
        own = [n for n in vars(part) if n in streaming]

        assert own, f"{part.__name__} serves no RPC"
        for name in own:
            expected = "async generator" if streaming[name] else "coroutine"
            assert form(getattr(part, name)) == expected, f"{part.__name__}.{name}"
