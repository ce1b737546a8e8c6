"""SyncClient's direct path: single-primary requests on a blocking channel, whole-table reads
fanned out to the primaries, and their fallbacks.

The blocking client runs in a thread (it has its own event loop) against an in-process
cluster served by the test's loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from shared.client import NeuroshardError, SyncClient
from shared.client.async_client import _quality_dict
from shared.client.direct import DirectPath
from shared.proto import common_pb2, coordinator_pb2
from shared.rpc.codec import f32_from_bytes, ids_from_bytes

pytestmark = pytest.mark.integration


class Counting(DirectPath):
    """A direct path that counts replies, and can pretend a reply was lost."""

    replies = 0
    lose_next = False

    def call(self, m, w, send):  # type: ignore[no-untyped-def]
        reply = super().call(m, w, send)
        if reply is not None and Counting.lose_next:
            Counting.lose_next = False
            return None  # the worker applied it; the client saw no answer
        Counting.replies += reply is not None
        return reply


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> type[Counting]:
    import shared.client.sync_client as client_module

    Counting.replies, Counting.lose_next = 0, False
    monkeypatch.setattr(client_module, "DirectPath", Counting)
    return Counting


async def test_single_ids_go_direct_and_read_back_what_was_written(
    make_cluster, counting: type[Counting]
) -> None:
    # Arrange
    cluster = await make_cluster(workers=3, slots=64)
    ids = np.arange(1, 41, dtype=np.uint64) * 7919
    strengths = np.linspace(0.1, 0.9, 40, dtype=np.float32)

    def work() -> tuple[list[float], list[bool], int]:
        with SyncClient(cluster.address, timeout_s=10) as c:
            c.wait_ready(30)
            c.upsert(ids[:2], strengths[:2])  # fetches the map (the async way)
            for i in range(2, 40):
                assert c.upsert(ids[i : i + 1], strengths[i : i + 1]) == 1
            found, got, _ = zip(*(c.get(ids[i : i + 1]) for i in range(40)), strict=True)
            assert c.delete(ids[:1]) == 1
            return [float(g[0]) for g in got], [bool(f[0]) for f in found], c.get(ids)[0].sum()

    # Act
    got, found, left = await asyncio.to_thread(work)

    # Assert: 38 upserts, 40 gets and a delete answered on the direct path, all correct
    assert found == [True] * 40
    np.testing.assert_array_equal(np.array(got, np.float32), strengths)
    assert counting.replies == 38 + 40 + 1
    assert left == 39


async def test_a_write_whose_reply_was_lost_is_applied_once(
    make_cluster, counting: type[Counting]
) -> None:
    # Arrange: one stored id
    cluster = await make_cluster(workers=3, slots=64)
    one = np.array([7919], np.uint64)

    def work() -> float:
        with SyncClient(cluster.address, timeout_s=10) as c:
            c.wait_ready(30)
            c.upsert(one, np.array([0.5], np.float32))
            counting.lose_next = True
            # Act: the direct reinforce is applied but its reply "lost"; the async router
            # sends it again with the same request id
            c.reinforce(one, np.array([0.25], np.float32))
            return float(c.get(one)[1][0])

    got = await asyncio.to_thread(work)

    # Assert: the workers de-duplicated the second send
    assert got == np.float32(0.75)


async def test_quality_and_topk_go_to_the_primaries_and_equal_the_coordinators(
    make_cluster,
) -> None:
    # Arrange: 40 memories of known strengths
    cluster = await make_cluster(workers=3, slots=64)
    ids = np.arange(1, 41, dtype=np.uint64) * 7919
    strengths = np.linspace(0.1, 0.9, 40, dtype=np.float32)

    def work() -> dict[str, Any]:
        with SyncClient(cluster.address, timeout_s=10) as c:
            c.wait_ready(30)
            c.upsert(ids, strengths)
            # Act: direct reads; then after a stale map (the workers refuse its epoch)
            got: dict[str, Any] = {"q": c.quality(), "top": c.topk(5)}
            got["coordinator_dialed"] = c._reads._channel is not None
            router = c._client._router
            current = router.cached_map
            stale = common_pb2.SlotMap()
            stale.CopyFrom(current)
            stale.epoch -= 1
            router._map = stale
            got["after_stale"] = c.quality(), c.topk(5)
            got["epoch"] = (router.cached_map.epoch, current.epoch)
            got["coordinator_dialed_after_stale"] = c._reads._channel is not None
            # the coordinator's answers, and its refusals
            got["coordinator"] = (
                c._reads.call(
                    "Quality", coordinator_pb2.QualityRequest(), common_pb2.QualityStats, 10
                ),
                c._reads.call(
                    "TopK", coordinator_pb2.TopKRequest(k=5), common_pb2.TopKResponse, 10
                ),
            )
            got["errors"] = []
            for call in (lambda: c.topk(5, table="nope"), lambda: c.topk(0)):
                try:
                    call()
                except NeuroshardError as exc:
                    got["errors"].append(exc.code.name)
            return got

    got = await asyncio.to_thread(work)

    # Assert: answered by the primaries without the coordinator, equal to what was written
    # and to the coordinator's merge, bit for bit; a stale map is refreshed, not fatal
    assert not got["coordinator_dialed"] and not got["coordinator_dialed_after_stale"]
    q, (top_ids, top_strengths) = got["q"], got["top"]
    assert q["count"] == 40
    assert q["max"] == pytest.approx(0.9)
    np.testing.assert_array_equal(top_ids, ids[::-1][:5])
    np.testing.assert_array_equal(top_strengths, strengths[::-1][:5])
    cq, ctop = got["coordinator"]
    assert q == _quality_dict(cq)
    np.testing.assert_array_equal(top_ids, ids_from_bytes(ctop.ids))
    np.testing.assert_array_equal(top_strengths, f32_from_bytes(ctop.strengths))
    assert got["after_stale"][0] == q
    np.testing.assert_array_equal(got["after_stale"][1][0], top_ids)
    assert got["epoch"][0] == got["epoch"][1]
    assert got["errors"] == ["NOT_FOUND", "INVALID_ARGUMENT"]
