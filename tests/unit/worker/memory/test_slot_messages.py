"""worker/memory/wire.py's slot copies: messages of about chunk_bytes, payloads counted, so a slot
of large payloads stays under the gRPC message limit; reassembled, the slot is whole."""

from __future__ import annotations

import numpy as np

from worker.memory.wire import receive_slots, slot_messages
from worker.store.store import SlotSnapshot


async def _stream(msgs):
    for m in msgs:
        yield m


async def test_payload_heavy_slots_are_cut_by_bytes_and_reassemble_whole() -> None:
    ids = np.arange(10, dtype=np.uint64) * 1024  # all in one slot is not needed here
    big = {int(i): bytes([k]) * 40_000 for k, i in enumerate(ids.tolist()) if k % 2}
    snap = SlotSnapshot(5, 77, ids, np.linspace(0, 1, 10, dtype=np.float32), big)

    msgs = slot_messages(snap, 64_000)
    (back,) = await receive_slots(_stream(msgs), 1 << 30)

    assert max(m.ByteSize() for m in msgs) < 2 * 64_000  # one 40 kB payload at most each
    assert len(msgs) == 5 and [m.first for m in msgs] == [True] + [False] * 4
    assert (back.slot, back.seq) == (5, 77)
    assert back.ids.tolist() == ids.tolist() and back.strengths.tolist() == snap.strengths.tolist()
    assert back.payloads == big


def test_an_empty_slot_is_one_message_carrying_its_seq() -> None:
    snap = SlotSnapshot(3, 9, np.empty(0, np.uint64), np.empty(0, np.float32))

    (msg,) = slot_messages(snap, 1 << 20)

    assert (msg.slot, msg.seq, msg.first, msg.ids) == (3, 9, True, b"")


async def test_a_slots_request_ids_are_cut_by_bytes_and_rejoined() -> None:
    # Issue 19 #5: 8192 request ids of 64 bytes (512 KiB) rode in the first message.
    rids = [i.to_bytes(8, "little") * 8 for i in range(8192)]
    ids = np.arange(0, 4000, dtype=np.uint64)
    snap = SlotSnapshot(0, 9, ids, np.full(len(ids), 0.5, np.float32), {}, rids)

    msgs = slot_messages(snap, 16 * 1024)
    (back,) = await receive_slots(_stream(msgs), 1 << 30)

    assert max(m.ByteSize() for m in msgs) < 2 * 16 * 1024 + 1024
    assert back.requests == rids
    np.testing.assert_array_equal(back.ids, ids)
