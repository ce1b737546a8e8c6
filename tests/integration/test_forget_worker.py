"""``forget-worker`` against a real in-process cluster: two workers holding both copies of
some slots die; forgetting them re-creates exactly those slots empty, counted right."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from coordinator.placement.membership import WorkerState
from shared.cli.main import main
from shared.client import NeuroshardError
from shared.memory.slots import slot_of
from tests.conftest import wait_until
from tests.integration.memory_helpers import SMALL_COPIES, SMALL_MESSAGES

pytestmark = pytest.mark.integration

SLOTS = 64
FAST_HEARTBEATS = dict(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.6)


async def kill_abruptly(worker) -> None:
    """Stop serving and heartbeating at once, as kill -9 would (no drain, no goodbye)."""
    if worker._tasks is not None:
        worker._tasks.cancel()
    await worker.rpc.server.stop(0)


def _reported(cluster, ids: np.ndarray) -> bool:
    """Every worker's last heartbeat counted, per slot, what the map gives it of ``ids``."""
    c = cluster.coordinator.cluster
    m = c.rebalancer.current
    per_slot = np.bincount(slot_of(ids, SLOTS), minlength=SLOTS)
    for w in c.membership.alive():
        held = [s for s in range(SLOTS) if w.name in (m.primary[s], m.replica[s])]
        want = {s: int(per_slot[s]) for s in held if per_slot[s]}
        if w.slot_memories != want:
            return False
    return True


def _state(cluster) -> tuple:
    """What a dry run must not change: members, the map, the trust of copies, the database."""
    c = cluster.coordinator.cluster
    m = c.rebalancer.current
    return (
        [(w.name, w.state.value) for w in c.membership.all()],
        (m.epoch, list(m.primary), list(m.replica)),
        c.rebalancer.trust.to_doc(),
        sorted(w.name for w in c.state.load_workers()),
    )


def _held(cluster, name: str) -> list[int]:
    """The slots the published map gives ``name`` (either role)."""
    m = cluster.coordinator.cluster.rebalancer.current
    return [s for s in range(SLOTS) if name in (m.primary[s], m.replica[s])]


async def test_forget_worker_recreates_only_the_sole_copies_and_counts_them(
    make_cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Arrange: 4 workers; worker-0 and worker-1 die together, so the slots they held both
    # copies of have no live copy (kept with them, in case they come back)
    cluster = await make_cluster(
        workers=4, slots=SLOTS, worker_overrides=SMALL_MESSAGES, **FAST_HEARTBEATS, **SMALL_COPIES
    )
    c = cluster.coordinator.cluster
    ids = np.arange(1, 4_001, dtype=np.uint64) * 7_919
    async with cluster.client() as client:
        await client.wait_ready()
        await client.upsert(ids, np.full(len(ids), 0.5, np.float32))
        await wait_until(lambda: _reported(cluster, ids), what="per-slot heartbeats")
        m = c.rebalancer.current
        both = [s for s in range(SLOTS) if {m.primary[s], m.replica[s]} == {"worker-0", "worker-1"}]
        lost_ids = ids[np.isin(slot_of(ids, SLOTS), both)]
        assert both and len(lost_ids)  # rendezvous over 4 workers gives them ~1/6 of the slots
        with pytest.raises(NeuroshardError) as alive:
            await client.forget_worker("worker-0", confirm=True)
        with pytest.raises(NeuroshardError) as unknown:
            await client.forget_worker("worker-9")
        await kill_abruptly(cluster.workers[0])
        await kill_abruptly(cluster.workers[1])
        await wait_until(
            lambda: (
                all(c.membership.get(n).state is WorkerState.DEAD for n in ("worker-0", "worker-1"))
                and c.rebalancer.settled.is_set()
            ),
            what="both dead and the map settled",
        )
        # Which of the two the map still names depends on the order they were declared
        # dead in: one declared first leaves the map (the other's copy went on alone), so
        # only slots naming both keep a second trusted copy.
        held_0, held_1 = _held(cluster, "worker-0"), _held(cluster, "worker-1")
        shared = sorted(set(held_0) & set(held_1))
        before = _state(cluster)
        with pytest.raises(NeuroshardError) as no_export:
            await client.export_memories(tmp_path / "before.npz")

        # Act: a dry run of worker-1, forget worker-0, a dry run of worker-1 through the
        # CLI, then forget it for real
        first_dry = await client.forget_worker("worker-1")
        unchanged = _state(cluster)
        forgot_0 = await client.forget_worker("worker-0", confirm=True)
        capsys.readouterr()
        dry_exit = await asyncio.to_thread(
            main, ["forget-worker", "worker-1", "--coordinator", cluster.address]
        )
        dry_out = capsys.readouterr().out
        forgot_1 = await client.forget_worker("worker-1", confirm=True)
        await wait_until(
            lambda: (
                c.rebalancer.settled.is_set()
                and c.rebalancer.slot_summary()["under_replicated_slots"] == 0
            ),
            what="every slot on two live workers",
        )
        status = await client.status()
        quality = await client.quality()
        found, _, _ = await client.get(ids)
        exported = await client.export_memories(tmp_path / "after.npz")

    # Assert
    def memories_of(slots: list[int]) -> int:
        return int(np.isin(slot_of(ids, SLOTS), slots).sum())

    assert alive.value.code.name == "FAILED_PRECONDITION"
    assert "worker 'worker-0' is ALIVE" in str(alive.value)
    assert unknown.value.code.name == "NOT_FOUND"
    assert sorted(set(held_0) | set(held_1)) == both  # they hold nothing else any more
    alone_1 = sorted(set(held_1) - set(shared))
    assert first_dry == {
        "worker": "worker-1",
        "forgotten": False,
        "lost_slots": alone_1,
        "lost_memories": memories_of(alone_1),
        "slots_kept": len(shared),
    }
    assert unchanged == before
    assert no_export.value.code.name == "UNAVAILABLE"
    assert f"slot {both[0]} has no live copy: its holders (" in str(no_export.value)
    assert "forget-worker" in str(no_export.value)
    alone_0 = sorted(set(held_0) - set(shared))
    assert forgot_0 == {
        "worker": "worker-0",
        "forgotten": True,
        "lost_slots": alone_0,
        "lost_memories": memories_of(alone_0),
        "slots_kept": len(shared),
    }
    assert dry_exit == 1
    assert (
        f"forgetting worker-1 would re-create {len(held_1)} slots empty, losing "
        f"{memories_of(held_1)} memories (per slot, as its last heartbeat reported them)" in dry_out
    )
    assert forgot_1 == {
        "worker": "worker-1",
        "forgotten": True,
        "lost_slots": held_1,
        "lost_memories": memories_of(held_1),
        "slots_kept": 0,
    }
    assert forgot_0["lost_memories"] + forgot_1["lost_memories"] == len(lost_ids)
    assert [w["name"] for w in status["workers"]] == ["worker-2", "worker-3"]
    m = c.rebalancer.current
    assert all(m.primary[s] in ("worker-2", "worker-3") for s in range(SLOTS))
    assert status["under_replicated_slots"] == 0
    assert quality["count"] == len(ids) - len(lost_ids)
    assert not found[np.isin(ids, lost_ids)].any() and found[~np.isin(ids, lost_ids)].all()
    assert [w.name for w in c.state.load_workers()] == ["worker-2", "worker-3"]
    assert exported["memories"] == len(ids) - len(lost_ids)
