"""coordinator/memory/store_export.py's message cutting: about chunk_bytes each, payloads counted,
every memory once and in order."""

from __future__ import annotations

import numpy as np

from coordinator.memory.store_export import Batch, cut_chunks
from shared.rpc.codec import f32_from_bytes, ids_from_bytes


def _joined(chunks) -> tuple[list[int], list[float], dict[int, bytes]]:
    ids = np.concatenate([ids_from_bytes(c.ids) for c in chunks]).tolist()
    s = np.concatenate([f32_from_bytes(c.strengths) for c in chunks]).tolist()
    payloads = {i: p for c in chunks for i, p in zip(c.payload_ids, c.payloads, strict=True)}
    return ids, s, payloads


def test_plain_memories_are_cut_at_the_chunk_size() -> None:
    ids = np.arange(1000, dtype=np.uint64)
    batch = Batch(ids, np.linspace(0, 1, 1000, dtype=np.float32))

    chunks = cut_chunks(batch, 1200, slots_done=7)  # 100 memories of 12 bytes

    assert [len(c.ids) // 8 for c in chunks] == [100] * 10
    assert [c.slots_done for c in chunks] == [7] * 10
    got_ids, got_s, _ = _joined(chunks)
    assert got_ids == ids.tolist() and got_s == batch.strengths.tolist()


def test_payloads_count_toward_the_size_and_a_big_one_travels_alone() -> None:
    ids = np.arange(10, dtype=np.uint64)
    payloads = {3: b"a" * 5000, 4: b"b" * 10, 8: b"c" * 100}
    batch = Batch(ids, np.full(10, 0.5, np.float32), payloads)

    chunks = cut_chunks(batch, 1000, slots_done=1)

    sizes = [
        sum(12 + len(payloads.get(i, b"")) for i in ids_from_bytes(c.ids).tolist()) for c in chunks
    ]
    assert [ids_from_bytes(c.ids).tolist() for c in chunks] == [[0, 1, 2], [3], [4, 5, 6, 7, 8, 9]]
    assert sizes == [36, 5012, 182]
    got_ids, _, got_payloads = _joined(chunks)
    assert got_ids == list(range(10)) and got_payloads == payloads


def test_an_empty_batch_is_one_empty_message_carrying_the_progress() -> None:
    batch = Batch(np.empty(0, np.uint64), np.empty(0, np.float32))

    chunks = cut_chunks(batch, 1000, slots_done=64)

    assert len(chunks) == 1 and chunks[0].ids == b"" and chunks[0].slots_done == 64
