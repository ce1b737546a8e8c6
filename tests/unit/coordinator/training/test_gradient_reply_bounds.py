"""A worker's ComputeGradients reply is bounded by the model's shapes (issue 19, #10).

The attack: a compromised worker answers with tensors it declares huge, of names the model
does not have, with more data than declared, or with parts that together exceed what any
wire form needs. ``read_gradients`` (the coordinator's reader of every reply) must refuse at
the first such chunk, before its bytes are kept.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import AsyncIterator

import numpy as np
import pytest

from coordinator.training.train_members import read_gradients, reply_budget
from shared.proto import common_pb2, worker_pb2
from shared.rpc.codec import CodecError, tensors_to_chunks
from shared.rpc.limits import BudgetExceeded

MODEL = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(3, np.float32)}


async def _reply(
    chunks: list[common_pb2.TensorChunk],
) -> AsyncIterator[worker_pb2.GradientResponse]:
    yield worker_pb2.GradientResponse(result=worker_pb2.StepResult(samples=1))
    for c in chunks:
        yield worker_pb2.GradientResponse(grad=c)


def _chunk(name: str, shape: list[int], data: bytes, dtype: str = "float32", total: int = -1):
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize if total < 0 else total
    return common_pb2.TensorChunk(
        name=name, dtype=dtype, shape=shape, offset=0, data=data, total_bytes=n
    )


async def test_a_reply_of_the_models_shapes_is_read() -> None:
    grads = {"w": np.ones((4, 3), np.float32), "b": np.full(3, 2.0, np.float32)}
    chunks = list(tensors_to_chunks(grads.items(), 16))

    _, got = await read_gradients(_reply(chunks), MODEL)

    np.testing.assert_array_equal(got["w"], grads["w"])
    np.testing.assert_array_equal(got["b"], grads["b"])


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        (
            _chunk("w", [1 << 30, 4], b"\0" * 64),
            "tensor 'w': shape [1073741824, 4], expected [4, 3]",
        ),
        (_chunk("evil", [1 << 28], b"\0" * 64), "tensor 'evil' is not one of the expected tensors"),
        (_chunk("w#idx", [1 << 28], b"\0" * 64, "int64"), "tensor 'w#idx': 2147483648 bytes"),
        (
            _chunk("w", [4, 3], b"\0" * 48, total=1 << 40),
            "needs 48 bytes, got 1099511627776 (tensor 'w')",
        ),
        (_chunk("w", [4, 3], b"\0" * 4096), "data runs past its 48 bytes"),
    ],
)
async def test_a_reply_not_of_the_models_shapes_is_refused_before_it_is_kept(
    chunk: common_pb2.TensorChunk, message: str
) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(CodecError) as info:
            await read_gradients(_reply([chunk]), MODEL)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert message in str(info.value)
    assert peak < 1 << 20  # nothing of the declared size was allocated


async def test_parts_beyond_the_calls_budget_are_resource_exhausted() -> None:
    # Each part alone fits the 8-bytes-per-element bound of a compressed part; together they
    # exceed what any wire form of the model needs (12 bytes per element + 64 per tensor).
    parts = [_chunk(f"w#p{i}", [12], b"\0" * 96, "float64") for i in range(4)]

    with pytest.raises(BudgetExceeded) as info:
        await read_gradients(_reply(parts), MODEL)

    assert "tensor 'w#p" in str(info.value)
    assert f"budget of {reply_budget(MODEL)}" in str(info.value)
