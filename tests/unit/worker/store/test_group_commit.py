"""Group commit (worker/store/group_commit.py behind Journal.sync with fsync: always): writes that
arrive while an fsync runs share the next one; a failed fsync fails every waiting write and
every later one (issue 12, item 2)."""

from __future__ import annotations

import asyncio
import errno
import os
import threading

import numpy as np
import pytest

from tests.conftest import wait_until
from tests.unit.worker.store.test_journal import Recorder
from worker.store import journal as journal_mod
from worker.store.journal import StorageFailed

WRITES = 10


def gated_fsync(monkeypatch, fail: bool = False) -> tuple[threading.Event, list[int]]:
    """Make fsyncs block until the returned gate opens (then succeed, or fail with EIO)."""
    gate, calls = threading.Event(), []
    real = os.fsync

    def fsync(fd: int) -> None:
        calls.append(fd)
        assert gate.wait(10), "the gate was never opened"
        if fail:
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(journal_mod.os, "fsync", fsync)
    return gate, calls


def _append(r: Recorder, i: int) -> int:
    ids = np.arange(i * 10, i * 10 + 10, dtype=np.uint64)
    return r.upsert(ids, np.full(10, 0.5, np.float32), rid=b"w%d" % i)


async def test_writes_arriving_during_an_fsync_share_the_next_one(tmp_path, monkeypatch):
    # Arrange: the first write's fsync is held at the gate.
    r = Recorder(tmp_path, policy="always")
    gate, calls = gated_fsync(monkeypatch)
    first = asyncio.ensure_future(r.journal.sync(_append(r, 0)))
    await wait_until(lambda: len(calls) == 1, what="the first fsync")

    # Act: WRITES more writes arrive while it runs, each waiting for its record; then the
    # disk answers.
    later = [asyncio.ensure_future(r.journal.sync(_append(r, i))) for i in range(1, WRITES)]
    gate.set()
    await asyncio.wait_for(asyncio.gather(first, *later), timeout=10)

    # Assert: two fsyncs in all, the second covering every later write.
    assert len(calls) == 2
    assert r.journal.synced == r.journal.written
    r.journal.close()


async def test_a_failed_fsync_fails_every_waiting_write_and_every_later_one(tmp_path, monkeypatch):
    # Arrange: a first write's fsync held at the gate, which then fails.
    r = Recorder(tmp_path, policy="always")
    gate, calls = gated_fsync(monkeypatch, fail=True)
    waiting = [asyncio.ensure_future(r.journal.sync(_append(r, 0)))]
    await wait_until(lambda: len(calls) == 1, what="the first fsync")
    waiting += [asyncio.ensure_future(r.journal.sync(_append(r, i))) for i in range(1, WRITES)]

    # Act
    gate.set()
    results = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), timeout=10)

    # Assert: no write acknowledged, one fsync tried and never again, later writes refused.
    assert all(isinstance(e, StorageFailed) for e in results), results
    with pytest.raises(StorageFailed, match="acknowledges no more writes"):
        _append(r, WRITES)
    with pytest.raises(StorageFailed, match="fsync: .*Input/output error"):
        await r.journal.sync(1)
    assert len(calls) == 1 and r.journal.synced < r.journal.written
    r.journal.close()


async def test_kick_starts_the_fsync_before_anyone_waits(tmp_path, monkeypatch):
    # Arrange
    r = Recorder(tmp_path, policy="always")
    gate, calls = gated_fsync(monkeypatch)
    pos = _append(r, 0)

    # Act: the store thread's kick, as DurableStore does right after an append.
    r.journal.kick(pos)

    # Assert: the fsync runs with no waiter; a wait afterwards costs no second fsync.
    await wait_until(lambda: len(calls) == 1, what="the kicked fsync")
    gate.set()
    await asyncio.wait_for(r.journal.sync(pos), timeout=10)
    assert len(calls) == 1 and r.journal.synced >= pos
    r.journal.close()
