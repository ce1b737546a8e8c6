"""The allreduce servicer's error table: each domain error raised inside RunAllreduce ends the
call with its status and message (``_ERRORS``), the header and rendezvous checks it makes
itself, and what becomes of the job's child. No network, no process: the sessions and the
child are stand-ins."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from shared.config import ConfigError
from shared.proto import worker_pb2 as pb
from shared.rpc.status_table import BadRequest
from shared.training.data import DataError
from shared.training.entry_points import EntryPointRefused
from shared.training.models import ModelError
from tests.fake_context import FakeContext, outcome
from worker.allreduce.allreduce_servicer import _ERRORS, AllreduceServicer, GenerationDropped
from worker.allreduce.allreduce_sessions import ChildFailed
from worker.allreduce.child_pipe import Frame
from worker.training.shards import ShardFetchError

SC = grpc.StatusCode
SECRET = "ab" * 32


class Child:
    """A child whose generation yields ``frames`` then raises ``error`` (if any)."""

    def __init__(self, frames: list[Frame], error: Exception | None = None) -> None:
        self.lock = asyncio.Lock()
        self.frames, self.error = frames, error

    async def generation(self, _order: Any, _state: bytes) -> AsyncIterator[Frame]:
        for frame in self.frames:
            yield frame
        if self.error is not None:
            raise self.error

    async def request_stop(self) -> None:
        pass


class Sessions:
    """The children by job id: ``child`` raises ``error`` or returns ``child``."""

    def __init__(self, error: Exception | None = None, child: Child | None = None) -> None:
        self.error, self._child = error, child or Child([Frame("ended", {})])
        self.stopped: list[str] = []

    async def child(self, job_id: str, spec_json: str) -> Child:
        if self.error is not None:
            raise self.error
        return self._child

    def stop(self, job_id: str) -> None:
        self.stopped.append(job_id)


def head(**fields: Any) -> pb.AllreduceInput:
    base: dict[str, Any] = {"job_id": "j1", "world_size": 2, "rendezvous_secret": SECRET}
    return pb.AllreduceInput(header=pb.AllreduceHeader(**(base | fields)))


async def stream(*messages: pb.AllreduceInput) -> AsyncIterator[pb.AllreduceInput]:
    for m in messages:
        yield m


async def run(sessions: Sessions, *messages: pb.AllreduceInput) -> tuple[Any, str]:
    context = FakeContext()
    servicer = AllreduceServicer(sessions, chunk_bytes=1024)
    return await outcome(servicer.RunAllreduce(stream(*messages), context), context)


def case(error: Exception, code: grpc.StatusCode) -> Any:
    return pytest.param(error, code, id=type(error).__name__)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        case(ConfigError("kind: expected 'train'"), SC.INVALID_ARGUMENT),
        case(DataError("data.name: unknown data set 'x'"), SC.INVALID_ARGUMENT),
        case(ModelError("model.args: unexpected keyword 'widht'"), SC.INVALID_ARGUMENT),
        case(EntryPointRefused("model.entry 'x:y' is not allowed here"), SC.PERMISSION_DENIED),
        case(ShardFetchError("FetchShard of job j1: no job", SC.NOT_FOUND), SC.NOT_FOUND),
        case(ChildFailed("the training process of job j1 exited"), SC.FAILED_PRECONDITION),
    ],
)
async def test_getting_the_child_maps_each_domain_error(
    error: Exception, code: grpc.StatusCode
) -> None:
    result = await run(Sessions(error), head())

    assert result == (code, str(error))


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "the first message must be a header"),
        ([pb.AllreduceInput(rendezvous="")], "the first message must be a header"),
        ([head(rank=2)], "rank 2 is not below world_size 2"),
        (
            [head(rendezvous_secret="abc")],
            "rendezvous_secret: expected at least 32 hex digits (an even number), got 3 characters",
        ),
        (
            [head(state_follows=True), pb.AllreduceInput(rendezvous="")],
            "expected state chunks after the header",
        ),
        (
            [head(rank=1), pb.AllreduceInput(rendezvous="")],
            "rendezvous: rank 1 got '' (rank 0 gets '', the others rank 0's host:port)",
        ),
    ],
    ids=["no-message", "no-header", "rank", "secret", "state", "rendezvous"],
)
async def test_a_malformed_call_is_invalid_argument(
    messages: list[pb.AllreduceInput], message: str
) -> None:
    assert await run(Sessions(), *messages) == (SC.INVALID_ARGUMENT, message)


async def test_a_generation_dropped_before_its_rendezvous_keeps_the_child() -> None:
    sessions = Sessions()

    result = await run(sessions, head())

    assert result == (SC.CANCELLED, "no rendezvous: generation dropped")
    assert sessions.stopped == []


async def test_a_child_dying_mid_generation_is_failed_precondition_and_is_stopped() -> None:
    died = ChildFailed("the training process of job j1 died (exit code -9)")
    sessions = Sessions(child=Child([Frame("progress", {"step": 3})], died))

    result = await run(sessions, head(), pb.AllreduceInput(rendezvous=""))

    assert result == (SC.FAILED_PRECONDITION, str(died))
    assert sessions.stopped == ["j1"]


async def test_a_generation_that_ends_leaves_the_child_for_the_next() -> None:
    sessions = Sessions()
    context = FakeContext()
    servicer = AllreduceServicer(sessions, chunk_bytes=1024)

    events = [
        e
        async for e in servicer.RunAllreduce(
            stream(head(), pb.AllreduceInput(rendezvous="")),
            context,
        )
    ]

    assert [e.WhichOneof("part") for e in events] == ["loaded", "ended"]
    assert sessions.stopped == [] and context.code is None


def test_every_rule_of_the_table_has_a_case_here() -> None:
    covered = {ConfigError, DataError, ModelError, EntryPointRefused, ShardFetchError}
    covered |= {ChildFailed, BadRequest, GenerationDropped}
    assert {cls for cls, _rule in _ERRORS.rules} == covered
