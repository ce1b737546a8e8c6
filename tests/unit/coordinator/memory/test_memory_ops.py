"""coordinator/memory/memory_ops.py's bulk operations with fake worker stubs, no cluster.

Each fake worker holds a few memories (ids, strengths) and answers Decay, Sweep, Quality and
TopK as a worker's primary slots would, applying each decay op id once (as
``worker/store/dedup.py`` does). The merged answers are checked against statistics and a
top-k computed here over the union of the primaries' memories. Shape letters: none (ids [N]
uint64, strengths [N] float32).
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
from grpc import aio

from coordinator.memory.memory_ops import BulkOpError, MemoryOps
from coordinator.placement.membership import Membership
from coordinator.placement.slot_map import SlotMap
from shared.memory.stats import Quality
from shared.proto import common_pb2, worker_pb2
from shared.rpc.codec import f32_to_bytes, ids_to_bytes
from tests.conftest import wait_until

# a and b are the primaries; c holds replicas only: its memory 100 must never be counted.
MAP = SlotMap(7, ["a", "b", "a", "b"], ["c", "c", "c", "a"])
STORES = {
    "a": ([5, 1, 9, 12], [0.9, 0.2, 0.75, 0.5]),
    "b": ([3, 7, 20], [0.9, 1.0, 0.05]),  # 3 ties with a's 5: the smaller id ranks first
    "c": ([100], [0.99]),
}
OP_ID = bytes(range(16))


def rpc_error(code: grpc.StatusCode, details: str) -> aio.AioRpcError:
    return aio.AioRpcError(code, aio.Metadata(), aio.Metadata(), details=details)


def quality_of(strengths: np.ndarray) -> Quality:
    """The statistics of one set of strengths, written from ``Quality``'s docstring."""
    s = np.asarray(strengths, np.float32)
    if s.size == 0:
        return Quality(0, 0.0, 0.0, 0.0, 0.0, (0,) * 10)
    bins = np.minimum((s.astype(np.float64) * 10).astype(np.int64), 9)  # 1.0 in the last bin
    total = float(s.astype(np.float64).sum())
    return Quality(
        int(s.size),
        total,
        total / s.size,
        float(s.min()),
        float(s.max()),
        tuple(int(c) for c in np.bincount(bins, minlength=10)),
    )


def top_of(ids: np.ndarray, strengths: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k strongest (id, strength), strongest first, ties to the smaller id."""
    pairs = sorted(zip(ids.tolist(), strengths.tolist(), strict=True), key=lambda p: (-p[1], p[0]))
    return pairs[:k]


class FakeWorker:
    """One worker's stub over its own memories; records each call and may fail or wait."""

    def __init__(self, name: str, lock: asyncio.Lock) -> None:
        ids, strengths = STORES[name]
        self.name, self._lock = name, lock
        self.ids = np.asarray(ids, np.uint64)
        self.strengths = np.asarray(strengths, np.float32)
        self.applied: set[bytes] = set()  # decay op ids applied (dedup)
        self.calls: list[tuple[str, Any]] = []  # (rpc, request)
        self.fail: list[BaseException] = []  # raised by the next calls, in order
        self.always_fail: BaseException | None = None
        self.gate: asyncio.Event | None = None  # calls wait for it when set
        self.finished = 0  # calls that returned
        self.lock_held: list[bool] = []  # whether map_lock was held during each call
        self.on_call: Any = None  # runs at the start of each call

    async def _enter(self, rpc: str, req: Any) -> None:
        self.calls.append((rpc, req))
        self.lock_held.append(self._lock.locked())
        if self.on_call is not None:
            self.on_call()
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise self.fail.pop(0)
        if self.always_fail is not None:
            raise self.always_fail

    def _decay(self, rate: float, op_id: bytes) -> None:
        if rate > 0 and op_id not in self.applied:
            self.applied.add(op_id)
            self.strengths = np.clip(self.strengths - np.float32(rate), 0, 1).astype(np.float32)

    def _quality_pb(self) -> common_pb2.QualityStats:
        q = quality_of(self.strengths)
        return common_pb2.QualityStats(
            count=q.count, sum=q.sum, mean=q.mean, min=q.min, max=q.max, histogram=q.histogram
        )

    def _topk_pb(self, k: int) -> common_pb2.TopKResponse:
        top = top_of(self.ids, self.strengths, k)
        return common_pb2.TopKResponse(
            ids=ids_to_bytes(np.array([i for i, _ in top], np.uint64)),
            strengths=f32_to_bytes(np.array([s for _, s in top], np.float32)),
        )

    async def Decay(  # noqa: N802 - the proto's RPC name
        self,
        req: worker_pb2.WorkerDecayRequest,
        timeout: float,  # noqa: ASYNC109 - the keyword of a grpc stub call
    ) -> common_pb2.DecayResponse:
        await self._enter("Decay", req)
        self._decay(req.rate, req.op_id)
        self.finished += 1
        return common_pb2.DecayResponse(memories=len(self.ids))

    async def Sweep(  # noqa: N802
        self,
        req: worker_pb2.WorkerSweepRequest,
        timeout: float,  # noqa: ASYNC109
    ) -> worker_pb2.WorkerSweepResponse:
        await self._enter("Sweep", req)
        self._decay(req.rate, req.op_id)
        self.finished += 1
        return worker_pb2.WorkerSweepResponse(
            memories=len(self.ids),
            quality=self._quality_pb() if req.want_quality else None,
            topk=self._topk_pb(req.k),
        )

    async def Quality(  # noqa: N802
        self,
        req: worker_pb2.WorkerQualityRequest,
        timeout: float,  # noqa: ASYNC109
    ) -> common_pb2.QualityStats:
        await self._enter("Quality", req)
        self.finished += 1
        return self._quality_pb()

    async def TopK(  # noqa: N802
        self,
        req: worker_pb2.WorkerTopKRequest,
        timeout: float,  # noqa: ASYNC109
    ) -> common_pb2.TopKResponse:
        await self._enter("TopK", req)
        self.finished += 1
        return self._topk_pb(req.k)


class Harness:
    """MemoryOps over a stand-in rebalancer (map and lock), a real Membership, fake stubs."""

    def __init__(self, retry_budget_s: float = 10.0) -> None:
        self.rebalancer = SimpleNamespace(map_lock=asyncio.Lock(), current=MAP)
        self.membership = Membership(heartbeat_timeout_s=10.0)
        for n in STORES:
            self.membership.register(n, f"{n}:1", "cpu")
        self.workers = {n: FakeWorker(n, self.rebalancer.map_lock) for n in STORES}
        self.ops = MemoryOps(
            self.rebalancer,  # type: ignore[arg-type]
            self.membership,
            self,  # type: ignore[arg-type]  # stands in for WorkerClients
            rpc_timeout_s=5.0,
            retry_budget_s=retry_budget_s,
        )

    def stub(self, name: str, address: str) -> FakeWorker:
        assert address == f"{name}:1", "the stub is looked up by the worker's own address"
        return self.workers[name]

    def primaries_union(self) -> tuple[np.ndarray, np.ndarray]:
        ws = [self.workers[n] for n in ("a", "b")]
        return np.concatenate([w.ids for w in ws]), np.concatenate([w.strengths for w in ws])


def assert_same_quality(got: Quality, want: Quality) -> None:
    assert (got.count, got.min, got.max, got.histogram) == (
        want.count,
        want.min,
        want.max,
        want.histogram,
    )
    assert got.sum == pytest.approx(want.sum) and got.mean == pytest.approx(want.mean)


async def test_decay_goes_once_to_each_primary_with_the_epoch_and_one_new_op_id() -> None:
    h = Harness()

    memories = await h.ops.decay(0.25)

    assert memories == 4 + 3  # a's and b's; c holds replicas only
    assert h.workers["c"].calls == []
    reqs = [h.workers[n].calls for n in ("a", "b")]
    assert [[rpc for rpc, _ in calls] for calls in reqs] == [["Decay"], ["Decay"]]
    (_, ra), (_, rb) = reqs[0][0], reqs[1][0]
    assert (ra.epoch, rb.epoch) == (7, 7)
    assert ra.rate == rb.rate == 0.25
    assert ra.op_id == rb.op_id and len(ra.op_id) == 16
    assert h.workers["a"].lock_held == [True] and h.workers["b"].lock_held == [True]

    await h.ops.decay(0.25)

    assert h.workers["a"].calls[1][1].op_id != ra.op_id  # each decay gets its own id


async def test_a_retryable_failure_is_resent_with_the_same_op_id_over_the_moved_map() -> None:
    # Arrange: b fails UNAVAILABLE and, meanwhile, the map moves its slots to a (epoch 8).
    h = Harness()
    moved = SlotMap(8, ["a"] * 4, ["c"] * 4)

    def die() -> None:
        h.rebalancer.current = moved
        h.workers["a"].ids = np.concatenate([h.workers["a"].ids, h.workers["b"].ids])
        h.workers["a"].strengths = np.concatenate(
            [h.workers["a"].strengths, h.workers["b"].strengths]
        )

    h.workers["b"].on_call = die
    h.workers["b"].fail = [rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")]

    # Act
    memories = await h.ops.decay(0.5, OP_ID)

    # Assert: a got the op twice (epochs 7 then 8), b once; the count is the second
    # fan-out's alone, each memory once.
    a_calls, b_calls = h.workers["a"].calls, h.workers["b"].calls
    assert [(r.epoch, r.op_id) for _, r in a_calls] == [(7, OP_ID), (8, OP_ID)]
    assert [(r.epoch, r.op_id) for _, r in b_calls] == [(7, OP_ID)]
    assert memories == 7


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.FAILED_PRECONDITION,  # a stale epoch: the map moved
    ],
)
async def test_a_sweep_retry_reuses_the_op_id_so_no_slot_decays_twice(
    code: grpc.StatusCode,
) -> None:
    # Arrange: b fails once after a applied the decay.
    h = Harness()
    h.workers["b"].fail = [rpc_error(code, "try again")]
    ids0, strengths0 = h.primaries_union()

    # Act
    result = await h.ops.sweep(0.1, OP_ID, k=3, want_quality=True)

    # Assert: two fan-outs, one op id; the answers are those of one decay of each memory.
    assert len(h.workers["a"].calls) == len(h.workers["b"].calls) == 2
    assert {r.op_id for w in "ab" for _, r in h.workers[w].calls} == {OP_ID}
    decayed = np.clip(strengths0 - np.float32(0.1), 0, 1).astype(np.float32)
    assert result.memories == 7
    assert result.quality is not None
    assert_same_quality(result.quality, quality_of(decayed))
    want = top_of(ids0, decayed, 3)
    assert result.ids.tolist() == [i for i, _ in want]
    assert result.strengths.tolist() == [s for _, s in want]


async def test_a_refusal_is_not_retried_and_the_error_names_the_op_and_the_primary() -> None:
    h = Harness()
    h.workers["b"].always_fail = rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "bad rate")

    with pytest.raises(BulkOpError) as caught:
        await h.ops.decay(0.5, OP_ID)

    assert len(h.workers["b"].calls) == 1
    message = str(caught.value)
    assert message.startswith(f"decay op {OP_ID.hex()} may be applied on part of the store")
    assert "1 of 2 primaries failed (b; first: b: bad rate)" in message
    assert message.endswith("a retry with the same op id completes it")
    assert not caught.value.retryable


async def test_the_retry_budget_bounds_the_resends_of_a_decay() -> None:
    h = Harness(retry_budget_s=0.3)
    h.workers["b"].always_fail = rpc_error(grpc.StatusCode.UNAVAILABLE, "down")
    t0 = time.monotonic()

    with pytest.raises(BulkOpError, match=OP_ID.hex()):
        await h.ops.decay(0.5, OP_ID)

    assert 2 <= len(h.workers["b"].calls) <= 10  # backoff 50 ms, doubling, within 0.3 s
    assert time.monotonic() - t0 < 5.0
    # a applied it on the first send only; the resends carried the same id.
    assert {r.op_id for _, r in h.workers["a"].calls} == {OP_ID}
    assert len(h.workers["a"].applied) == 1


def unavailable() -> aio.AioRpcError:
    return rpc_error(grpc.StatusCode.UNAVAILABLE, "down")


@pytest.mark.parametrize(
    ("failures", "retryable"),
    [
        ({"a": unavailable()}, True),
        ({"a": rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "slow")}, True),
        ({"a": rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "stale epoch")}, True),
        ({"a": rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "no")}, False),
        ({"a": unavailable(), "b": rpc_error(grpc.StatusCode.INTERNAL, "bug")}, False),
        ({"a": ConnectionError("reset")}, False),  # not a gRPC status: nothing to go by
    ],
)
async def test_a_read_fails_at_once_and_says_whether_a_retry_may_pass(
    failures: dict[str, BaseException], retryable: bool
) -> None:
    h = Harness()
    for name, exc in failures.items():
        h.workers[name].always_fail = exc

    with pytest.raises(BulkOpError) as caught:
        await h.ops.quality()

    assert caught.value.retryable is retryable
    assert [len(h.workers[n].calls) for n in "ab"] == [1, 1]  # no resend
    first = failures["a"]
    detail = first.details() if isinstance(first, aio.AioRpcError) else str(first)
    names = ", ".join(sorted(failures))
    assert str(caught.value) == (
        f"quality: {len(failures)} of 2 primaries failed ({names}; first: a: {detail})"
    )


async def test_an_unknown_primary_is_a_retryable_error_and_nothing_is_sent() -> None:
    h = Harness()
    h.rebalancer.current = SlotMap(9, ["a", "z", "a", "b"], ["b", "a", "b", "a"])

    with pytest.raises(BulkOpError, match="topk: primary z is unknown") as caught:
        await h.ops.topk(2)

    assert caught.value.retryable
    assert all(w.calls == [] for w in h.workers.values())


async def test_a_bulk_op_waits_for_a_publication_and_uses_the_map_it_published() -> None:
    # Arrange: a publication holds map_lock.
    h = Harness()
    await h.rebalancer.map_lock.acquire()
    task = asyncio.create_task(h.ops.quality())
    for _ in range(5):
        await asyncio.sleep(0)  # let the task run as far as it can

    # Act: nothing went out; the publication moves the map and releases the lock.
    assert all(w.calls == [] for w in h.workers.values())
    h.rebalancer.current = SlotMap(8, list(MAP.primary), list(MAP.replica))
    h.rebalancer.map_lock.release()
    await task

    # Assert: the op read the published map, and held the lock while it ran.
    assert [r.epoch for n in "ab" for _, r in h.workers[n].calls] == [8, 8]
    assert h.workers["a"].lock_held == [True]


async def test_quality_and_topk_merge_the_primaries_answers_exactly() -> None:
    h = Harness()
    ids, strengths = h.primaries_union()

    quality = await h.ops.quality()
    top_ids, top_strengths = await h.ops.topk(3)

    assert_same_quality(quality, quality_of(strengths))
    assert quality.max == pytest.approx(1.0) and quality.count == 7  # c's 0.99 left out
    want = top_of(ids, strengths, 3)
    assert top_ids.tolist() == [i for i, _ in want] == [7, 3, 5]
    assert top_strengths.dtype == np.float32 and top_ids.dtype == np.uint64
    assert top_strengths.tolist() == [s for _, s in want]
    assert [r.k for n in "ab" for rpc, r in h.workers[n].calls if rpc == "TopK"] == [3, 3]


async def test_a_sweep_without_quality_or_topk_decays_only() -> None:
    h = Harness()

    result = await h.ops.sweep(0.2, b"", k=0, want_quality=False)

    assert result.memories == 7 and result.quality is None
    assert (result.ids.size, result.strengths.size) == (0, 0)
    [(_, ra)] = h.workers["a"].calls
    assert (ra.rate, ra.k, ra.want_quality, len(ra.op_id)) == (pytest.approx(0.2), 0, False, 16)
    assert h.workers["a"].strengths.tolist() == pytest.approx([0.7, 0.0, 0.55, 0.3])


async def test_a_decay_whose_caller_gives_up_still_completes() -> None:
    # Arrange: the workers hold their answers until released.
    h = Harness()
    gate = asyncio.Event()
    for w in h.workers.values():
        w.gate = gate
    caller = asyncio.create_task(h.ops.decay(0.5, OP_ID))
    await wait_until(lambda: all(h.workers[n].calls for n in "ab"), what="decay sent")

    # Act: the caller is cancelled (its client went away), then the workers answer.
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    gate.set()

    # Assert: the fan-out was not torn down half-way: both primaries applied it.
    await wait_until(
        lambda: all(h.workers[n].finished for n in "ab") and not h.rebalancer.map_lock.locked(),
        what="decay applied",
    )
    assert all(OP_ID in h.workers[n].applied for n in "ab")
