"""coordinator/forget.py without a cluster: which slots forgetting a dead worker loses, what
they held, and that a refused or dry-run request changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.forget import WorkerNotDead, WorkerUnknown, count_lost, forget_worker, sole_copies
from coordinator.persistence import StateStore
from coordinator.placement.membership import Membership
from coordinator.placement.slot_map import SlotMap
from coordinator.placement.slot_trust import SlotTrust

# slot: 0 (d0, a)   1 (d0, d1)   2 (a, d0)   3 (d0, "")   4 (b, a)   5 (d0, b)
# a and b are alive; d0 and d1 are dead; b's copy of slot 5 is untrusted.
MAP = SlotMap(7, ["d0", "d0", "a", "d0", "b", "d0"], ["a", "d1", "d0", "", "a", "b"])


class FakeRebalancer:
    """What ``forget_worker`` uses of the rebalancer: the map, the trust, ``distrust``."""

    def __init__(self) -> None:
        self.current = MAP
        self.trust = SlotTrust(MAP.slots)
        self.triggered = 0

    def distrust(self, name: str, slots: list[int] | None = None) -> None:
        self.trust.distrust(name, slots)
        self.triggered += 1


def test_sole_copies_are_those_with_no_other_trusted_holder() -> None:
    untrusted = {"b": {5}}

    lost, kept = sole_copies(MAP, untrusted, "d0")

    # 0: a holds it; 1: d1 (dead, may return) holds it; 2: a; 3: none; 5: b's is untrusted
    assert (lost, kept) == ([3, 5], 3)


def test_an_untrusted_copy_of_the_forgotten_worker_is_neither_lost_nor_kept() -> None:
    lost, kept = sole_copies(MAP, {"d0": {3, 5}}, "d0")

    assert (lost, kept) == ([], 3)


def test_a_worker_holding_nothing_loses_nothing() -> None:
    assert sole_copies(MAP, {}, "zz") == ([], 0)


def test_lost_memories_come_from_the_per_slot_report() -> None:
    assert count_lost({3: 40, 5: 2, 0: 1000}, [3, 5]) == 42
    assert count_lost({0: 5}, [3]) == 0  # an empty slot is not reported
    assert count_lost(None, [3]) is None  # no heartbeat since the coordinator started


def _setup(tmp_path: Path) -> tuple[Membership, FakeRebalancer, StateStore]:
    m = Membership(10.0)
    state = StateStore(tmp_path)
    for name in ("a", "b", "d0", "d1"):
        m.register(name, f"{name}:1", "cpu", "p")
        state.save_worker(name, f"{name}:1", "cpu", "p")
    m.mark_dead("d0")
    m.mark_dead("d1")
    m.get("d0").slot_memories = {0: 10, 1: 20, 2: 30, 3: 40, 5: 2}  # type: ignore[union-attr]
    rb = FakeRebalancer()
    rb.trust.distrust("b", [5])
    return m, rb, state


def test_a_dry_run_reports_and_changes_nothing(tmp_path: Path) -> None:
    m, rb, state = _setup(tmp_path)
    before = (rb.trust.to_doc(), [w.name for w in m.all()], len(state.load_workers()))

    report = forget_worker("d0", False, m, rb, state)  # type: ignore[arg-type]

    assert (report.lost_slots, report.lost_memories, report.slots_kept) == ([3, 5], 42, 3)
    assert report.forgotten is False
    after = (rb.trust.to_doc(), [w.name for w in m.all()], len(state.load_workers()))
    assert after == before and rb.triggered == 0
    state.close()


def test_confirming_forgets_the_worker_and_distrusts_its_copies(tmp_path: Path) -> None:
    m, rb, state = _setup(tmp_path)

    report = forget_worker("d0", True, m, rb, state)  # type: ignore[arg-type]

    assert report.forgotten and report.lost_slots == [3, 5] and report.lost_memories == 42
    assert m.get("d0") is None and rb.triggered == 1
    assert rb.trust.untrusted["d0"] == set(range(MAP.slots))
    assert sorted(w.name for w in state.load_workers()) == ["a", "b", "d1"]
    state.close()


def test_an_alive_or_unknown_worker_is_refused(tmp_path: Path) -> None:
    m, rb, state = _setup(tmp_path)

    with pytest.raises(WorkerNotDead) as alive:
        forget_worker("a", True, m, rb, state)  # type: ignore[arg-type]
    m.set_draining("b")
    with pytest.raises(WorkerNotDead) as draining:
        forget_worker("b", True, m, rb, state)  # type: ignore[arg-type]
    with pytest.raises(WorkerUnknown) as unknown:
        forget_worker("nobody", True, m, rb, state)  # type: ignore[arg-type]

    assert str(alive.value).startswith("worker 'a' is ALIVE: only a DEAD worker can be forgotten")
    assert str(draining.value).startswith("worker 'b' is DRAINING")
    assert str(unknown.value) == "no worker named 'nobody'"
    assert m.get("a") is not None and m.get("b") is not None and rb.triggered == 0
    state.close()
