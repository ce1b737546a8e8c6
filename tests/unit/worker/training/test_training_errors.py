"""The training servicer's error table: each domain error raised inside StartTraining or
ComputeGradients ends the call with its status and message (``_ERRORS``), and the request
checks it makes itself. No network, no torch: the sessions are a stand-in that raises."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import pytest

from shared.config import ConfigError
from shared.proto import worker_pb2 as pb
from shared.rpc.codec import CodecError, f32_to_bytes, rows_to_bytes
from shared.rpc.status_table import BadRequest
from shared.training.data import DataError
from shared.training.entry_points import EntryPointRefused
from shared.training.models import ModelError
from tests.fake_context import FakeContext, outcome
from worker.training.shards import ShardFetchError, ShardMissing
from worker.training.trainer import DeviceUnavailable, TrainerError
from worker.training.training_servicer import _ERRORS, TrainingServicer
from worker.training.training_sessions import BadParams, StepInput, UnknownTrainingJob

SC = grpc.StatusCode
START = pb.StartTrainingRequest(job_id="j1", spec_json="{}", shard_index=0, shard_count=2)


class Sessions:
    """Training sessions whose ``start`` and ``step`` raise ``error`` (None: they answer)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.steps: list[StepInput] = []

    async def start(self, *_args: Any) -> int:
        if self.error is not None:
            raise self.error
        return 0

    async def step(self, call: StepInput) -> Any:
        self.steps.append(call)
        if self.error is not None:
            raise self.error
        return None  # the worker holds no usable parameters


def header(**fields: Any) -> pb.StepHeader:
    """A well-formed step header of rows [3, 4, 5], changed by ``fields``."""
    base: dict[str, Any] = {
        "job_id": "j1",
        "params_version": 2,
        "explicit_rows": True,
        "rows": rows_to_bytes(np.array([3, 4, 5])),
    }
    return pb.StepHeader(**(base | fields))


async def stream(*messages: pb.GradientRequest) -> AsyncIterator[pb.GradientRequest]:
    for m in messages:
        yield m


async def compute(sessions: Any, *messages: pb.GradientRequest) -> tuple[Any, str]:
    context = FakeContext()
    servicer = TrainingServicer(sessions, chunk_bytes=1024)
    return await outcome(servicer.ComputeGradients(stream(*messages), context), context)


def case(error: Exception, code: grpc.StatusCode) -> Any:
    """A parametrize case: the message is the error's text (a KeyError's unquoted)."""
    text = str(error.args[0])
    return pytest.param(error, code, text, id=type(error).__name__)


START_CASES = [
    case(ConfigError("kind: expected 'train', got 'memory'"), SC.INVALID_ARGUMENT),
    case(DataError("data.path: this worker has no coordinator"), SC.INVALID_ARGUMENT),
    case(ModelError("model.args: unexpected keyword 'widht'"), SC.INVALID_ARGUMENT),
    case(EntryPointRefused("model.entry 'x:y' is not allowed here"), SC.PERMISSION_DENIED),
    case(DeviceUnavailable("worker w0: device: cuda asked for"), SC.FAILED_PRECONDITION),
    case(ShardFetchError("FetchShard of job j1 shard 0: no job", SC.NOT_FOUND), SC.NOT_FOUND),
]
STEP_CASES = [
    case(UnknownTrainingJob("no training session for job 'j1'"), SC.FAILED_PRECONDITION),
    case(ShardMissing("shard 2 of 3 is not held here"), SC.FAILED_PRECONDITION),
    case(TrainerError("no parameters set"), SC.FAILED_PRECONDITION),
    case(BadParams("param: parameter 'fc.weight': expected shape (10, 64)"), SC.INVALID_ARGUMENT),
    case(ValueError("rows: indices must be in [0, 1437)"), SC.INVALID_ARGUMENT),
    case(DataError("shard 2: labels outside [0, 10)"), SC.INVALID_ARGUMENT),
    case(ShardFetchError("FetchShard of job j1 shard 2: down", SC.UNAVAILABLE), SC.UNAVAILABLE),
]


@pytest.mark.parametrize(("error", "code", "message"), START_CASES)
async def test_start_training_maps_each_domain_error(
    error: Exception, code: grpc.StatusCode, message: str
) -> None:
    context = FakeContext()
    servicer = TrainingServicer(Sessions(error), chunk_bytes=1024)

    result = await outcome(servicer.StartTraining(START, context), context)

    assert result == (code, message)


async def test_start_training_refuses_a_shard_index_out_of_range() -> None:
    context = FakeContext()
    servicer = TrainingServicer(Sessions(), chunk_bytes=1024)
    request = pb.StartTrainingRequest(job_id="j1", shard_index=2, shard_count=2)

    result = await outcome(servicer.StartTraining(request, context), context)

    assert result == (SC.INVALID_ARGUMENT, "shard_index 2 is not below shard_count 2")


@pytest.mark.parametrize(("error", "code", "message"), STEP_CASES)
async def test_compute_gradients_maps_each_domain_error_of_the_step(
    error: Exception, code: grpc.StatusCode, message: str
) -> None:
    result = await compute(Sessions(error), pb.GradientRequest(header=header()))

    assert result == (code, message)


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "the stream has no StepHeader"),
        (
            [pb.GradientRequest(header=header(explicit_rows=False, rows=b""))],
            "explicit_rows: must be true, with the step's rows in rows",
        ),
        (
            [pb.GradientRequest(header=header(loss_scale=float("nan")))],
            "loss_scale: must be finite and >= 0, got nan",
        ),
        ([pb.GradientRequest(header=header(rows=b"\x01\x02\x03"))], "rows: "),
        (
            [pb.GradientRequest(header=header(weights=f32_to_bytes([1.0, 0.5])))],
            "weights: 2 values for 3 rows",
        ),
        (
            [pb.GradientRequest(header=header(weights=f32_to_bytes([1.0, -0.5, 1.0])))],
            "weights: every importance weight must be finite and >= 0",
        ),
        (
            [pb.GradientRequest(header=header(weights=f32_to_bytes([1.0, np.nan, 1.0])))],
            "weights: every importance weight must be finite and >= 0",
        ),
        ([pb.GradientRequest(header=header(weights=b"\x01\x02"))], "weights: "),
    ],
    ids=[
        "no-header",
        "implicit-rows",
        "loss-scale",
        "rows",
        "weights-misaligned",
        "weights-negative",
        "weights-nan",
        "weights-bytes",
    ],
)
async def test_compute_gradients_refuses_a_malformed_request_before_the_step(
    messages: list[pb.GradientRequest], message: str
) -> None:
    sessions = Sessions()

    code, details = await compute(sessions, *messages)

    assert code is SC.INVALID_ARGUMENT and details.startswith(message), details
    assert sessions.steps == []


async def test_a_step_without_usable_parameters_answers_need_params_alone() -> None:
    sessions = Sessions()
    servicer = TrainingServicer(sessions, chunk_bytes=1024)
    request = pb.GradientRequest(header=header(inner_rows=[2, 1], loss_scale=0.0))

    replies = [r async for r in servicer.ComputeGradients(stream(request), FakeContext())]

    assert [r.result.need_params for r in replies] == [True]
    call = sessions.steps[0]
    assert call.rows.tolist() == [3, 4, 5] and call.inner_rows == (2, 1)
    assert (call.params, call.loss_scale, call.params_version) == (None, 1.0, 2)


def test_every_rule_of_the_table_has_a_case_here() -> None:
    raised = {type(c.values[0]) for c in START_CASES + STEP_CASES}
    checked_here = {BadRequest, CodecError}  # the malformed requests above
    assert {cls for cls, _rule in _ERRORS.rules} == raised | checked_here


async def test_importance_weights_reach_the_step_aligned_with_the_rows() -> None:
    sessions = Sessions()
    weights = np.array([1.0, 0.25, 0.5], np.float32)

    await compute(sessions, pb.GradientRequest(header=header(weights=f32_to_bytes(weights))))

    (call,) = sessions.steps
    assert call.weights is not None and call.weights.tolist() == weights.tolist()
    await compute(sessions, pb.GradientRequest(header=header()))
    assert sessions.steps[1].weights is None  # uniform: no weights
