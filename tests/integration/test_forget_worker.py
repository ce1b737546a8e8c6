"""``forget-worker`` against a real in-process cluster: two workers holding both copies of
some slots die; forgetting them re-creates exactly those slots empty, counted right."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from coordinator.membership import WorkerState
from shared.cli.main import main
from shared.client import NeuroshardError
from shared.memory.slots import slot_of
from tests.conftest import wait_until
from tests.integration.security_helpers import coordinator_state

pytestmark = pytest.mark.integration

SLOTS = 64
FAST_HEARTBEATS = dict(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.6)


async def kill_abruptly(worker) -> None:
    """Stop serving and heartbeating at once, as kill -9 would (no drain, no goodbye)."""
    if worker._tasks is not None:
        worker._tasks.cancel()
    await worker.server.stop(0)


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


async def test_forget_worker_recreates_only_the_sole_copies_and_counts_them(
    make_cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Arrange: 4 workers; worker-0 and worker-1 die together, so the slots they held both
    # copies of have no live copy (kept with them, in case they come back)
    cluster = await make_cluster(workers=4, slots=SLOTS, **FAST_HEARTBEATS)
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
        before = coordinator_state(cluster) | {"trust": c.rebalancer.trust.to_doc()}
        with pytest.raises(NeuroshardError) as no_export:
            await client.export_memories(tmp_path / "before.npz")

        # Act: a dry run of worker-1 (worker-0 still holds copies), forget worker-0 (loses
        # nothing), a dry run of worker-1 through the CLI, then forget it for real
        first_dry = await client.forget_worker("worker-1")
        unchanged = coordinator_state(cluster) | {"trust": c.rebalancer.trust.to_doc()}
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
    assert alive.value.code.name == "FAILED_PRECONDITION"
    assert "worker 'worker-0' is ALIVE" in str(alive.value)
    assert unknown.value.code.name == "NOT_FOUND"
    assert first_dry == {
        "worker": "worker-1",
        "forgotten": False,
        "lost_slots": [],
        "lost_memories": 0,
        "slots_kept": len(both),
    }
    assert unchanged == before
    assert no_export.value.code.name == "UNAVAILABLE"
    assert f"slot {both[0]} has no live copy: its holders (" in str(no_export.value)
    assert "forget-worker" in str(no_export.value)
    assert forgot_0["forgotten"] and forgot_0["lost_slots"] == [] and forgot_0["lost_memories"] == 0
    assert dry_exit == 1
    assert (
        f"forgetting worker-1 would re-create {len(both)} slots empty, losing "
        f"{len(lost_ids)} memories (per slot, as its last heartbeat reported them)" in dry_out
    )
    assert forgot_1 == {
        "worker": "worker-1",
        "forgotten": True,
        "lost_slots": both,
        "lost_memories": len(lost_ids),
        "slots_kept": 0,
    }
    assert [w["name"] for w in status["workers"]] == ["worker-2", "worker-3"]
    m = c.rebalancer.current
    assert all(m.primary[s] in ("worker-2", "worker-3") for s in range(SLOTS))
    assert status["under_replicated_slots"] == 0
    assert quality["count"] == len(ids) - len(lost_ids)
    assert not found[np.isin(ids, lost_ids)].any() and found[~np.isin(ids, lost_ids)].all()
    assert [w.name for w in c.state.load_workers()] == ["worker-2", "worker-3"]
    assert exported["memories"] == len(ids) - len(lost_ids)
