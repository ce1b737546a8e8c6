"""The ``neuroshard.v1.Worker`` service: one servicer that hands each RPC to its part.

A proto service is registered once, so one servicer serves it; its parts,
``MemoryServicer``, ``TrainingServicer`` and ``AllreduceServicer``, are each built with what
they need. The parts' docstrings say what each RPC does and answers.

Both daemons compose a service from parts this way (delegation; the coordinator's
``CoordinatorServicer`` hands the data set RPCs to its ``DataServicer``), not by mixing the
parts' classes into the registered one:

- a part receives what it needs in its constructor, where a mixin relies on attributes its
  host happens to set, and shares one namespace with the host and the other mixins (a helper
  or counter of the same name silently shadows another, in MRO order);
- the registered class names every RPC of the service and the part it goes to, in one file;
- an RPC that concerns two parts has one visible place (``StopTraining`` stops a job's
  allreduce child, then its training session);
- a part can be built and tested alone.

The cost is one forwarding method per RPC; a streaming one is an async generator itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from grpc import aio

from shared.proto import common_pb2, worker_pb2, worker_pb2_grpc
from worker.allreduce.allreduce_servicer import AllreduceServicer
from worker.memory.memory_servicer import MemoryServicer
from worker.training.training_servicer import TrainingServicer

__all__ = ["WorkerServicer"]


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Serves the Worker service by delegation."""

    def __init__(
        self, memory: MemoryServicer, training: TrainingServicer, allreduce: AllreduceServicer
    ) -> None:
        """Serve ``memory``'s, ``training``'s and ``allreduce``'s RPCs.

        Args:
            memory: the memory-store RPCs.
            training: the parameter-server training RPCs (``strategy: sync``).
            allreduce: ``RunAllreduce`` (``strategy: allreduce``).
        """
        self.memory = memory
        self.training = training
        self.allreduce = allreduce

    # -- training -------------------------------------------------------------------------------

    async def StartTraining(
        self, request: worker_pb2.StartTrainingRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.StartTrainingResponse:
        """See ``TrainingServicer.StartTraining``."""
        return await self.training.StartTraining(request, context)

    async def ComputeGradients(
        self,
        request_iterator: AsyncIterator[worker_pb2.GradientRequest],
        context: aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[worker_pb2.GradientResponse]:
        """See ``TrainingServicer.ComputeGradients``."""
        # An async generator itself: grpc.aio runs any other streaming handler as a sync one.
        async for response in self.training.ComputeGradients(request_iterator, context):
            yield response

    async def StopTraining(
        self, request: worker_pb2.StopTrainingRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.StopTrainingResponse:
        """See ``TrainingServicer.StopTraining``; an allreduce job's child is killed too."""
        self.allreduce.stop(request.job_id)
        return await self.training.StopTraining(request, context)

    async def RunAllreduce(
        self,
        request_iterator: AsyncIterator[worker_pb2.AllreduceInput],
        context: aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[worker_pb2.AllreduceEvent]:
        """See ``AllreduceServicer.RunAllreduce``."""
        async for event in self.allreduce.RunAllreduce(request_iterator, context):
            yield event

    # -- memory store ---------------------------------------------------------------------------

    async def Upsert(
        self, request: worker_pb2.UpsertRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.WriteResponse:
        """See ``MemoryServicer.Upsert``."""
        return await self.memory.Upsert(request, context)

    async def Get(
        self, request: worker_pb2.GetRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.GetResponse:
        """See ``MemoryServicer.Get``."""
        return await self.memory.Get(request, context)

    async def Delete(
        self, request: worker_pb2.DeleteRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.WriteResponse:
        """See ``MemoryServicer.Delete``."""
        return await self.memory.Delete(request, context)

    async def Reinforce(
        self, request: worker_pb2.ReinforceRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.WriteResponse:
        """See ``MemoryServicer.Reinforce``."""
        return await self.memory.Reinforce(request, context)

    async def Decay(
        self, request: worker_pb2.WorkerDecayRequest, context: aio.ServicerContext[Any, Any]
    ) -> common_pb2.DecayResponse:
        """See ``MemoryServicer.Decay``."""
        return await self.memory.Decay(request, context)

    async def Quality(
        self, request: worker_pb2.WorkerQualityRequest, context: aio.ServicerContext[Any, Any]
    ) -> common_pb2.QualityStats:
        """See ``MemoryServicer.Quality``."""
        return await self.memory.Quality(request, context)

    async def TopK(
        self, request: worker_pb2.WorkerTopKRequest, context: aio.ServicerContext[Any, Any]
    ) -> common_pb2.TopKResponse:
        """See ``MemoryServicer.TopK``."""
        return await self.memory.TopK(request, context)

    async def Sweep(
        self, request: worker_pb2.WorkerSweepRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.WorkerSweepResponse:
        """See ``MemoryServicer.Sweep``."""
        return await self.memory.Sweep(request, context)

    async def SampleSums(
        self, request: worker_pb2.WorkerSampleSumsRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.WorkerSampleSumsResponse:
        """See ``MemoryServicer.SampleSums``."""
        return await self.memory.SampleSums(request, context)

    async def SamplePick(
        self, request: worker_pb2.WorkerSamplePickRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.WorkerSamplePickResponse:
        """See ``MemoryServicer.SamplePick``."""
        return await self.memory.SamplePick(request, context)

    async def Replicate(
        self, request: worker_pb2.ReplicateRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.ReplicateResponse:
        """See ``MemoryServicer.Replicate``."""
        return await self.memory.Replicate(request, context)

    async def ApplySlotMap(
        self, request: common_pb2.SlotMap, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.ApplySlotMapResponse:
        """See ``MemoryServicer.ApplySlotMap``."""
        return await self.memory.ApplySlotMap(request, context)

    async def CopySlots(
        self, request: worker_pb2.CopySlotsRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.CopySlotsResponse:
        """See ``MemoryServicer.CopySlots``."""
        return await self.memory.CopySlots(request, context)

    async def ReceiveSlots(
        self,
        request_iterator: AsyncIterator[worker_pb2.SlotData],
        context: aio.ServicerContext[Any, Any],
    ) -> worker_pb2.ReceiveSlotsResponse:
        """See ``MemoryServicer.ReceiveSlots``."""
        return await self.memory.ReceiveSlots(request_iterator, context)

    async def DumpSlots(
        self, request: worker_pb2.DumpSlotsRequest, context: aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[worker_pb2.SlotData]:
        """See ``MemoryServicer.DumpSlots``."""
        async for msg in self.memory.DumpSlots(request, context):  # see ComputeGradients
            yield msg

    async def SlotSeqs(
        self, request: worker_pb2.SlotSeqsRequest, context: aio.ServicerContext[Any, Any]
    ) -> worker_pb2.SlotSeqsResponse:
        """See ``MemoryServicer.SlotSeqs``."""
        return await self.memory.SlotSeqs(request, context)
