"""The coordinator servicer's error table: each domain error raised inside an RPC ends the call
with its status and message (``_ERRORS``, ``shared.rpc.status_table``). No network: the
cluster is a stand-in whose parts raise; codes and messages are pinned literally."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from coordinator import coordinator_servicer
from coordinator.coordinator_servicer import _ERRORS, CoordinatorServicer, InsertFailed
from coordinator.data_servicer import DataServicer
from coordinator.forget import WorkerNotDead, WorkerUnknown
from coordinator.jobs.admission import LimitExceeded
from coordinator.jobs.jobs import JobNotFound, JobQuotaExceeded
from coordinator.jobs.pacing import BadGrant, PacingRefused
from coordinator.memory.memory_ops import BulkOpError
from coordinator.memory.sampling import SampleRefused
from coordinator.memory.store_export import ExportsBusy, ExportUnavailable
from coordinator.memory.tables import TableExists
from coordinator.placement.failure_detector import NotSlotPrimary, TooManyReports
from coordinator.placement.readmission import PUSHBACK_KEY, ReadmissionRefused
from coordinator.training.saved_models import ModelMissing
from shared.client.memory import RoutingError
from shared.config import ConfigError
from shared.memory.tables import TableNotFound
from shared.memory.validation import MemoryInputError
from shared.proto import coordinator_pb2 as pb
from shared.rpc.limits import BudgetExceeded
from shared.rpc.status_table import BadRequest
from shared.security.auth import AddressRefused, reset_principal, set_principal
from shared.security.confinement import PathRefused
from shared.security.tokens import DataTokenRefused, Principal
from shared.training.entry_points import EntryPointRefused
from tests.fake_context import FakeContext, outcome

SC = grpc.StatusCode
INF = float("inf")


def raising(exc: Exception, is_async: bool = True) -> Callable[..., Any]:
    """A stand-in for a cluster method that raises ``exc``."""

    async def async_fail(*_args: Any, **_kwargs: Any) -> Any:
        raise exc

    def fail(*_args: Any, **_kwargs: Any) -> Any:
        raise exc

    return async_fail if is_async else fail


def stand_in(cfg: dict[str, Any] | None = None, **parts: Any) -> Any:
    """A cluster with the config the RPCs read (``cfg`` overrides), and ``parts``."""
    config = {"report_rate_per_s": 2.0, "slots": 16, "topk_max": 100, "max_concurrent_exports": 4}
    parts.setdefault("tables", SimpleNamespace(check=lambda name: name or "default"))
    return SimpleNamespace(cfg=SimpleNamespace(**(config | (cfg or {}))), **parts)


@contextlib.contextmanager
def caller(principal: Principal | None) -> Iterator[None]:
    token = set_principal(principal)
    try:
        yield
    finally:
        reset_principal(token)


@dataclass(frozen=True)
class Case:
    """One RPC whose cluster raises a domain error (or whose request fails validation)."""

    error: type[Exception]
    rpc: str
    request: Any
    cluster: Any
    code: grpc.StatusCode
    message: str
    principal: Principal | None = None
    tokens: Callable[[Principal], tuple[str, float]] | None = None


NO_JOB = JobNotFound("no job with id 'j9'")
CASES = [
    Case(
        InsertFailed,
        "Insert",
        pb.InsertRequest(table="capped", request_id=b"r"),
        stand_in(
            tables=SimpleNamespace(
                spec=lambda name: SimpleNamespace(name=name, capacity=5, max_payload_bytes=8)
            ),
            inserts=SimpleNamespace(
                insert=raising(RoutingError("primary w1 unreachable", SC.UNAVAILABLE))
            ),
        ),
        SC.UNAVAILABLE,
        "primary w1 unreachable",
    ),
    Case(
        TableNotFound,
        "TopK",
        pb.TopKRequest(k=3, table="nope"),
        stand_in(
            tables=SimpleNamespace(
                check=raising(TableNotFound("table 'nope' does not exist"), False)
            )
        ),
        SC.NOT_FOUND,
        "table 'nope' does not exist",
    ),
    Case(
        TableExists,
        "CreateTable",
        pb.CreateTableRequest(name="replay"),
        stand_in(
            tables=SimpleNamespace(create=raising(TableExists("table 'replay' exists already")))
        ),
        SC.ALREADY_EXISTS,
        "table 'replay' exists already",
    ),
    Case(
        BadRequest,
        "RegisterWorker",
        pb.RegisterWorkerRequest(name="w0"),
        stand_in(),
        SC.INVALID_ARGUMENT,
        "name and address are required",
    ),
    Case(
        AddressRefused,
        "RegisterWorker",
        pb.RegisterWorkerRequest(name="w0", address="elsewhere:5000"),
        stand_in(),
        SC.PERMISSION_DENIED,
        "RegisterWorker: address 'elsewhere:5000': host 'elsewhere' is not among the names of "
        "worker 'w0''s certificate (localhost)",
        principal=Principal("w0", "worker", INF, hosts=("localhost",)),
    ),
    Case(
        ReadmissionRefused,
        "RegisterWorker",
        pb.RegisterWorkerRequest(name="w0", address="localhost:5000"),
        stand_in(
            readmission=SimpleNamespace(
                check=raising(ReadmissionRefused("worker w0 is held down for 1.5 s", 1.5))
            )
        ),
        SC.UNAVAILABLE,
        "worker w0 is held down for 1.5 s",
    ),
    Case(
        DataTokenRefused,
        "GetSlotMap",
        pb.GetSlotMapRequest(),
        stand_in(rebalancer=SimpleNamespace(wire_map=lambda: SimpleNamespace())),
        SC.UNAUTHENTICATED,
        "the caller's token expires within a second",
        principal=Principal("alice", "reader", 1.0, "neuroshard-coordinator"),
        tokens=raising(DataTokenRefused("the caller's token expires within a second"), False),
    ),
    Case(
        TooManyReports,
        "ReportFailure",
        pb.ReportFailureRequest(worker="w1"),
        stand_in(reports=SimpleNamespace(allow=lambda _subject: False)),
        SC.RESOURCE_EXHAUSTED,
        "ReportFailure: more than report_rate_per_s 2.0 reports a second from "
        "'ipv4:127.0.0.1:50000'",
    ),
    Case(
        NotSlotPrimary,
        "ReportFailure",
        pb.ReportFailureRequest(reporter="w0", worker="w1", slots=[3]),
        stand_in(report_failure=raising(NotSlotPrimary("w0 is not the primary of slot 3"), False)),
        SC.FAILED_PRECONDITION,
        "w0 is not the primary of slot 3",
    ),
    Case(
        MemoryInputError,
        "ReportFailure",
        pb.ReportFailureRequest(reporter="w0", worker="w1", slots=[1, 16]),
        stand_in(),
        SC.INVALID_ARGUMENT,
        "slots[1]: 16 is outside [0, 16)",
    ),
    Case(
        WorkerUnknown,
        "DrainWorker",
        pb.DrainWorkerRequest(name="nobody"),
        stand_in(drain=raising(WorkerUnknown("no worker named 'nobody'"), False)),
        SC.NOT_FOUND,
        "no worker named 'nobody'",
    ),
    Case(
        BulkOpError,
        "Quality",
        pb.QualityRequest(),
        stand_in(memory=SimpleNamespace(quality=raising(BulkOpError("worker w1 failed")))),
        SC.UNAVAILABLE,
        "worker w1 failed",
    ),
    Case(
        TableNotFound,
        "Sample",
        pb.SampleRequest(table="replay", n=4),
        stand_in(
            cfg={"max_sample_batch": 100},
            tables=SimpleNamespace(
                check=raising(TableNotFound("table 'replay' does not exist"), False)
            ),
        ),
        SC.NOT_FOUND,
        "table 'replay' does not exist",
    ),
    Case(
        SampleRefused,
        "Sample",
        pb.SampleRequest(n=4, min_size=9),
        stand_in(
            cfg={"max_sample_batch": 100},
            sampler=SimpleNamespace(sample=raising(SampleRefused("holds 3 memories"))),
        ),
        SC.FAILED_PRECONDITION,
        "holds 3 memories",
    ),
    Case(
        BudgetExceeded,
        "Sample",
        pb.SampleRequest(n=4),
        stand_in(
            cfg={"max_sample_batch": 100},
            sampler=SimpleNamespace(sample=raising(BudgetExceeded("reply too large"))),
        ),
        SC.RESOURCE_EXHAUSTED,
        "reply too large",
    ),
    Case(
        ConfigError,
        "SubmitJob",
        pb.SubmitJobRequest(spec_json="{}"),
        stand_in(submit=raising(ConfigError("kind: field required"))),
        SC.INVALID_ARGUMENT,
        "kind: field required",
    ),
    Case(
        PathRefused,
        "SubmitJob",
        pb.SubmitJobRequest(spec_json="{}"),
        stand_in(submit=raising(PathRefused("data.path: '/etc' is outside the data roots"))),
        SC.INVALID_ARGUMENT,
        "data.path: '/etc' is outside the data roots",
    ),
    Case(
        EntryPointRefused,
        "SubmitJob",
        pb.SubmitJobRequest(spec_json="{}"),
        stand_in(submit=raising(EntryPointRefused("model.entry: 'os:system' is not allowed"))),
        SC.PERMISSION_DENIED,
        "model.entry: 'os:system' is not allowed",
    ),
    Case(
        JobQuotaExceeded,
        "SubmitJob",
        pb.SubmitJobRequest(spec_json="{}"),
        stand_in(submit=raising(JobQuotaExceeded("8 unfinished jobs, max_jobs_per_client 8"))),
        SC.RESOURCE_EXHAUSTED,
        "8 unfinished jobs, max_jobs_per_client 8",
    ),
    Case(
        LimitExceeded,
        "SubmitJob",
        pb.SubmitJobRequest(spec_json="{}"),
        stand_in(submit=raising(LimitExceeded("epochs: 9000 is over max_epochs 1000"))),
        SC.RESOURCE_EXHAUSTED,
        "epochs: 9000 is over max_epochs 1000",
    ),
    Case(
        JobNotFound,
        "GetJob",
        pb.JobRequest(job_id="j9"),
        stand_in(jobs=SimpleNamespace(get=raising(NO_JOB, False))),
        SC.NOT_FOUND,
        "no job with id 'j9'",  # unquoted, as a KeyError's repr would not be
    ),
    Case(
        BadGrant,
        "RunEpochs",
        pb.RunEpochsRequest(job_id="j9", epochs=0),
        stand_in(
            jobs=SimpleNamespace(get=lambda _id: SimpleNamespace(owner="")),
            run_epochs=raising(BadGrant("epochs: must be at least 1, got 0")),
        ),
        SC.INVALID_ARGUMENT,
        "epochs: must be at least 1, got 0",
    ),
    Case(
        PacingRefused,
        "FinishJob",
        pb.JobRequest(job_id="j9"),
        stand_in(
            jobs=SimpleNamespace(get=lambda _id: SimpleNamespace(owner="")),
            finish=raising(PacingRefused("job 'j9' is not paced")),
        ),
        SC.FAILED_PRECONDITION,
        "job 'j9' is not paced",
    ),
    Case(
        JobNotFound,
        "WatchJob",
        pb.JobRequest(job_id="j9"),
        stand_in(jobs=SimpleNamespace(get=raising(NO_JOB, False))),
        SC.NOT_FOUND,
        "no job with id 'j9'",
    ),
    Case(
        ModelMissing,
        "GetModel",
        pb.GetModelRequest(job_id="train-1", best=True),
        stand_in(
            cfg={"data_dir": "/nonexistent-neuroshard-test", "chunk_bytes": 1024},
            jobs=SimpleNamespace(
                get=lambda _id: SimpleNamespace(job_id="train-1", kind="train", owner="")
            ),
        ),
        SC.NOT_FOUND,
        "job 'train-1' has no saved best model",
    ),
    Case(
        ExportsBusy,
        "ExportMemories",
        pb.ExportMemoriesRequest(),
        stand_in(cfg={"max_concurrent_exports": 0}),
        SC.RESOURCE_EXHAUSTED,
        "0 exports are running, max_concurrent_exports is 0; retry when one has finished",
    ),
]


def _ids(case: Case) -> str:
    return f"{case.rpc}-{case.error.__name__}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
async def test_a_domain_error_ends_the_call_with_its_status_and_message(case: Case) -> None:
    # Arrange
    servicer = CoordinatorServicer(
        case.cluster, DataServicer(case.cluster), data_tokens=case.tokens
    )
    context = FakeContext()

    # Act
    with caller(case.principal):
        call = getattr(servicer, case.rpc)(case.request, context)
        result = await outcome(call, context)

    # Assert
    assert result == (case.code, case.message)


async def test_a_held_down_worker_is_told_when_to_retry() -> None:
    refused = ReadmissionRefused("worker w0 is held down for 1.5 s", 1.5)
    cluster = stand_in(readmission=SimpleNamespace(check=raising(refused)))
    context = FakeContext()

    await outcome(
        CoordinatorServicer(cluster, DataServicer(cluster)).RegisterWorker(
            pb.RegisterWorkerRequest(name="w0", address="localhost:5000"), context
        ),
        context,
    )

    assert context.trailing_metadata == ((PUSHBACK_KEY, "1500"),)


async def test_an_export_that_loses_a_primary_is_unavailable(monkeypatch) -> None:
    class Failing:
        def __init__(self, *_args: Any, **_kwargs: Any) -> None:
            pass

        async def chunks(self) -> Any:
            yield pb.ExportChunk()
            raise ExportUnavailable("slot 3: no live primary")

    monkeypatch.setattr(coordinator_servicer, "StoreExport", Failing)
    cfg = {"max_concurrent_exports": 1, "rpc_timeout_s": 1.0, "chunk_bytes": 1024}
    cfg |= {"export_batch_bytes": 1024, "export_batch_memories": 10}
    cluster = stand_in(cfg, rebalancer=None, membership=None, clients=None)
    servicer = CoordinatorServicer(cluster, DataServicer(cluster))
    first, second = FakeContext(), FakeContext()

    a = await outcome(servicer.ExportMemories(pb.ExportMemoriesRequest(), first), first)
    b = await outcome(servicer.ExportMemories(pb.ExportMemoriesRequest(), second), second)

    # The second export was admitted: the failed one gave its place back.
    assert a == b == (SC.UNAVAILABLE, "slot 3: no live primary")


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (WorkerUnknown("no worker named 'w9'"), SC.NOT_FOUND, "no worker named 'w9'"),
        (WorkerNotDead("worker 'w1' is ALIVE"), SC.FAILED_PRECONDITION, "worker 'w1' is ALIVE"),
    ],
)
async def test_forgetting_maps_unknown_and_living_workers(
    monkeypatch, error: Exception, code: grpc.StatusCode, message: str
) -> None:
    monkeypatch.setattr(coordinator_servicer, "forget_worker", raising(error, False))
    cluster = stand_in(membership=None, rebalancer=None, state=None, events=None)
    context = FakeContext()

    result = await outcome(
        CoordinatorServicer(cluster, DataServicer(cluster)).ForgetWorker(
            pb.ForgetWorkerRequest(name="w"), context
        ),
        context,
    )

    assert result == (code, message)


def test_every_rule_of_the_table_has_a_case_here() -> None:
    covered = {c.error for c in CASES} | {ExportUnavailable, WorkerNotDead}
    assert {cls for cls, _rule in _ERRORS.rules} == covered
