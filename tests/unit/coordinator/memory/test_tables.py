"""The coordinator's table registry: specs, publication, persistence, insert stamps."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from coordinator.memory.capped_inserts import first_to_evict
from coordinator.memory.tables import STAMP_BLOCK, TableExists, Tables
from shared.memory.tables import TableNotFound
from shared.memory.validation import MemoryInputError
from shared.proto import common_pb2
from shared.rpc.codec import f32_to_bytes, ids_to_bytes


class FakeRebalancer:
    def __init__(self) -> None:
        self.map_lock = asyncio.Lock()
        self.published = 0
        self.tables = list

    async def publish_same(self) -> None:
        assert self.map_lock.locked()
        self.published += 1


async def test_create_drop_publish_and_persist() -> None:
    rb, saved = FakeRebalancer(), []
    tables = Tables(rb, 4096, persist=saved.append)  # type: ignore[arg-type]

    a = await tables.create("replay", 100, "weakest", 0, 0.25)
    b = await tables.create("other")
    with pytest.raises(TableExists):
        await tables.create("replay")
    await tables.drop("other")

    assert (a.id, b.id) == (1, 2) and rb.published == 3
    assert [t.name for t in rb.tables()] == ["replay"]  # what every wire map lists
    assert [t.name for t in tables.list()] == ["default", "replay"]
    assert a.max_payload_bytes == 4096 and a.forget_below == pytest.approx(0.25)
    restored = Tables(FakeRebalancer(), 4096)  # type: ignore[arg-type]
    restored.load_doc(saved[-1])
    assert restored.list() == tables.list()
    assert (await restored.create("other")).id == 3, "an incarnation id is never reused"
    with pytest.raises(TableNotFound, match="'nope'"):
        await tables.drop("nope")
    with pytest.raises(MemoryInputError, match="default"):
        await tables.drop("default")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(name=""), "name"),
        (dict(name="A"), "name"),
        (dict(name="x" * 65), "name"),
        (dict(name="default"), "name"),
        (dict(name="t", capacity=-1), "capacity"),
        (dict(name="t", eviction="lru"), "eviction"),
        (dict(name="t", max_payload_bytes=4097), "max_payload_bytes"),
        (dict(name="t", forget_below=-0.5), "forget_below"),
        (dict(name="t", forget_below=1.0), "forget_below"),
    ],
)
async def test_a_bad_spec_is_refused_naming_the_field_and_nothing_changes(kwargs, field) -> None:
    rb = FakeRebalancer()
    tables = Tables(rb, 4096)  # type: ignore[arg-type]
    with pytest.raises(MemoryInputError, match=f"^{field}"):
        await tables.create(**kwargs)
    assert rb.published == 0 and [t.name for t in tables.list()] == ["default"]


async def test_insert_stamps_only_grow_across_a_restart() -> None:
    saved: list = []
    tables = Tables(FakeRebalancer(), 4096, persist=saved.append)  # type: ignore[arg-type]
    await tables.create("capped", capacity=5)
    first = tables.take_stamps("capped", 3)
    second = tables.take_stamps("capped", 2)
    restored = Tables(FakeRebalancer(), 4096)  # type: ignore[arg-type]
    restored.load_doc(saved[-1])
    after = restored.take_stamps("capped", 2)

    assert first.tolist() == [1, 2, 3] and second.tolist() == [4, 5]
    assert after[0] > second[-1] and after[0] <= STAMP_BLOCK + 10


def test_the_global_first_to_evict_are_merged_from_every_primary() -> None:
    def reply(ids, strengths, stamps) -> common_pb2.TopKResponse:
        return common_pb2.TopKResponse(
            ids=ids_to_bytes(np.array(ids, np.uint64)),
            strengths=f32_to_bytes(np.array(strengths, np.float32)),
            stamps=ids_to_bytes(np.array(stamps, np.uint64)),
        )

    replies = [reply([5, 9], [0.5, 0.1], [7, 2]), reply([3, 4], [0.1, 0.9], [1, 8])]

    assert first_to_evict(replies, "oldest", 3).tolist() == [3, 9, 5]
    assert first_to_evict(replies, "weakest", 3).tolist() == [3, 9, 5]  # 0.1 tie: smaller id
    assert first_to_evict([], "weakest", 3).tolist() == []
