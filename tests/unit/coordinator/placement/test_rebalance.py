"""coordinator/placement/rebalance.py's Rebalancer with fake worker stubs, no cluster.

A pass decides restarted workers' copies, publishes the interim map, copies, then publishes
the target (behind a fence when a primary moves); the run loop re-plans while a verification
is pending or after a failed pass; the laggard push re-sends the map; ``slot_summary`` counts
only serving, verified, trusted copies. (Chunking of the copies: test_rebalance_copy.py.)

The fake stubs record every call in one log, in call order, so a test sees what went out
before what. Maps are 16 slots; the rendezvous placements the scenarios start from are
``assign_slots``' (its golden vectors are pinned in tests/unit/shared/memory).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from grpc import aio

from coordinator.events import EventLog
from coordinator.placement.membership import Membership
from coordinator.placement.rebalance import Rebalancer
from coordinator.placement.slot_map import SlotMap, WireLimits
from coordinator.placement.slot_trust import VerificationPending
from shared.memory.slots import assign_slots
from shared.metrics import Metrics
from shared.proto import common_pb2, worker_pb2
from tests.conftest import wait_until

SLOTS = 16
MEMORIES_PER_SLOT = 10  # what a fake source reports per slot it copied


def rendezvous(names: list[str], epoch: int) -> SlotMap:
    """The target placement over ``names`` (``assign_slots``), at ``epoch``."""
    p_idx, r_idx = assign_slots(names, SLOTS)
    pick = [*names, ""]  # index -1: none
    return SlotMap(epoch, [pick[i] for i in p_idx.tolist()], [pick[i] for i in r_idx.tolist()])


def decode(pb: common_pb2.SlotMap) -> SlotMap:
    """A wire map back to names (index -1: none)."""
    names = [*pb.workers, ""]
    return SlotMap(pb.epoch, [names[i] for i in pb.primary], [names[i] for i in pb.replica])


def unavailable(name: str) -> aio.AioRpcError:
    return aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, aio.Metadata(), aio.Metadata(), details=f"{name} is down"
    )


class FakeWorkers:
    """Stands in for ``WorkerClients``: every worker's stub logs its calls here, in order.

    Log entries: ("map", worker, epoch), ("copy", source, target, slots, epoch),
    ("seqs", worker, slots).
    """

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.maps: dict[int, SlotMap] = {}  # epoch -> the map published at it
        self.down: set[str] = set()  # these answer every call UNAVAILABLE
        self.seqs: dict[str, dict[int, int]] = {}  # worker -> slot -> seq (SlotSeqs)
        self.on_copy: Callable[[], None] | None = None  # runs inside each CopySlots

    def stub(self, name: str, address: str) -> SimpleNamespace:
        assert address == f"{name}:1", "the stub is looked up by the worker's own address"

        async def apply_slot_map(
            pb: common_pb2.SlotMap,
            timeout: float,  # noqa: ASYNC109 - the keyword of a grpc stub call
        ) -> worker_pb2.ApplySlotMapResponse:
            if name in self.down:
                raise unavailable(name)
            self.log.append(("map", name, pb.epoch))
            self.maps[pb.epoch] = decode(pb)
            return worker_pb2.ApplySlotMapResponse(epoch=pb.epoch)

        async def copy_slots(
            req: worker_pb2.CopySlotsRequest,
            timeout: float,  # noqa: ASYNC109
        ) -> worker_pb2.CopySlotsResponse:
            if name in self.down:
                raise unavailable(name)
            assert req.target_address == f"{req.target}:1"
            self.log.append(("copy", name, req.target, tuple(req.slots), req.epoch))
            if self.on_copy is not None:
                self.on_copy()
            return worker_pb2.CopySlotsResponse(memories=MEMORIES_PER_SLOT * len(req.slots))

        async def slot_seqs(
            req: worker_pb2.SlotSeqsRequest,
            timeout: float,  # noqa: ASYNC109
        ) -> worker_pb2.SlotSeqsResponse:
            self.log.append(("seqs", name, tuple(req.slots)))
            if name in self.down:
                raise unavailable(name)
            held = self.seqs.get(name, {})
            return worker_pb2.SlotSeqsResponse(seqs=[held.get(s, 0) for s in req.slots])

        return SimpleNamespace(
            ApplySlotMap=apply_slot_map, CopySlots=copy_slots, SlotSeqs=slot_seqs
        )

    def published(self) -> list[SlotMap]:
        """The maps that reached a worker, in the order of their first delivery."""
        epochs = dict.fromkeys(e for kind, _, e in self.of("map"))
        return [self.maps[e] for e in epochs]

    def receivers(self, epoch: int) -> list[str]:
        """The workers that received the map of ``epoch``, in call order."""
        return [n for _, n, e in self.of("map") if e == epoch]

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        return [entry for entry in self.log if entry[0] == kind]


class Harness:
    """A Rebalancer over a real Membership and fake stubs, with what it saved and told."""

    def __init__(self, *names: str) -> None:
        self.membership = Membership(heartbeat_timeout_s=10.0)
        for n in names:
            self.membership.register(n, f"{n}:1", "cpu", process_id=f"{n}-1")
        self.workers = FakeWorkers()
        self.metrics = Metrics()
        self.changes = 0
        self.saved: list[tuple[SlotMap, dict[str, object]]] = []
        self.rb = Rebalancer(
            SLOTS,
            self.membership,
            self.workers,  # type: ignore[arg-type]
            self.metrics,
            rpc_timeout_s=5.0,
            limits=WireLimits(4096, 1 << 20),
            on_change=self._changed,
            copy_chunk_memories=1 << 20,
            copy_pause_factor=0.0,
        )
        self.rb.events = EventLog()
        self.rb.persist = lambda m, doc: self.saved.append((m, doc))

    def _changed(self) -> None:
        self.changes += 1

    def start_at(self, current: SlotMap) -> None:
        """Publish ``current`` as already applied by every live worker (as heartbeats say)."""
        self.rb.current = current
        for w in self.membership.alive():
            self.membership.heartbeat(w.name, memories=0, epoch=current.epoch)

    def epoch_gauge(self) -> float | None:
        return self.metrics.registry.get_sample_value("neuroshard_slot_map_epoch")

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in reversed(self.rb.events.recent(200)) if e["kind"] == kind]


async def test_first_pass_publishes_the_rendezvous_map_to_every_worker() -> None:
    # Arrange: two workers join an empty cluster (the coordinator checks new workers too).
    h = Harness("a", "b")
    h.rb.worker_restarted("a")
    h.rb.worker_restarted("b")

    # Act
    await h.rb.rebalance()

    # Assert: nothing to compare or copy; the (empty) interim, then the target.
    interim, target = h.workers.published()
    assert interim == SlotMap(1, [""] * SLOTS, [""] * SLOTS)
    assert target == rendezvous(["a", "b"], 2)
    assert h.workers.of("seqs") == [] and h.workers.of("copy") == []
    assert sorted(h.workers.receivers(2)) == ["a", "b"]
    assert [h.membership.get(n).slot_map_epoch for n in "ab"] == [2, 2]
    assert h.rb.current == target and h.rb.trust.unverified == set()
    assert h.epoch_gauge() == 2 and h.changes == 2
    assert h.saved[-1] == (target, {"untrusted": {}, "unverified": []})


async def test_a_dead_primarys_replica_is_promoted_then_copies_then_the_target() -> None:
    # Arrange: a, b, c hold the rendezvous map at epoch 5; c dies.
    h = Harness("a", "b", "c")
    before = rendezvous(["a", "b", "c"], 5)
    h.start_at(before)
    h.membership.mark_dead("c")

    # Act
    await h.rb.rebalance()

    # Assert: the interim keeps live holders only, c's replicas promoted in its place.
    interim, *later = h.workers.published()
    pairs = list(zip(before.primary, before.replica, strict=True))
    held = [[x for x in pair if x != "c"] for pair in pairs]
    assert interim.epoch == 6
    assert interim.primary == [x[0] for x in held]
    assert interim.replica == [x[1] if len(x) > 1 else "" for x in held]
    # ... then the target over a and b, each publication one epoch later.
    assert later[-1] == rendezvous(["a", "b"], 6 + len(later))
    assert [m.epoch for m in later] == list(range(7, 7 + len(later)))
    # Every copy went out at the interim's epoch, from the slot's interim primary, to a
    # holder the target adds, after the interim and before the next publication.
    copies = h.workers.of("copy")
    added = {
        (s, x)
        for s in range(SLOTS)
        for x in (later[-1].primary[s], later[-1].replica[s])
        if x not in held[s]
    }
    sent = [(s, dst) for _, src, dst, slots, _ in copies for s in slots]
    assert sorted(sent) == sorted(added) and added
    assert all(e == 6 and all(interim.primary[s] == src for s in sl) for _, src, _, sl, e in copies)
    at = {
        kind: [i for i, x in enumerate(h.workers.log) if x[0] == kind] for kind in ("map", "copy")
    }
    interim_sent = [i for i in at["map"] if h.workers.log[i][2] == 6]
    assert max(interim_sent) < min(at["copy"])
    assert max(at["copy"]) < min(i for i in at["map"] if h.workers.log[i][2] > 6)
    # The dead worker was told nothing; the events say who was promoted and what was copied.
    assert "c" not in {n for _, n, _ in h.workers.of("map")}
    promoted = {r: sum(1 for p, r2 in pairs if p == "c" and r2 == r) for r in "ab"}
    assert {e["worker"]: e["slots"] for e in h.events("replicas_promoted")} == {
        n: k for n, k in promoted.items() if k
    }
    [copied] = h.events("slots_copied")
    assert copied["slots"] == len(added) == h.rb.copies_total
    assert copied["memories"] == MEMORIES_PER_SLOT * len(added)


async def test_a_joining_worker_gets_the_interim_and_losing_primaries_get_the_fence_first() -> None:
    # Arrange: b and c hold the rendezvous map at epoch 3; a joins (sorting first).
    h = Harness("b", "c")
    before = rendezvous(["b", "c"], 3)
    h.start_at(before)
    h.membership.register("a", "a:1", "cpu", process_id="a-1")
    h.rb.worker_restarted("a")

    # Act
    await h.rb.rebalance()

    # Assert: a holds nothing yet, so nothing is compared, but it adopts the interim (the
    # unchanged placement) before any copy reaches it.
    interim, fence, target = h.workers.published()
    assert h.workers.of("seqs") == []
    assert (interim.epoch, interim.primary, interim.replica) == (4, before.primary, before.replica)
    assert "a" in h.workers.receivers(4)
    assert h.workers.log.index(("map", "a", 4)) < h.workers.log.index(h.workers.of("copy")[0])
    # The fence takes the primary from exactly the slots whose primary moves to a ...
    want = rendezvous(["a", "b", "c"], 6)
    moving = [s for s in range(SLOTS) if want.primary[s] != before.primary[s]]
    assert moving and all(want.primary[s] == "a" for s in moving)
    assert fence.epoch == 5 and fence.replica == before.replica
    assert fence.primary == ["" if s in moving else before.primary[s] for s in range(SLOTS)]
    # ... and reaches the workers losing them (b and c here) before a.
    losing = sorted({before.primary[s] for s in moving})
    assert losing == ["b", "c"]
    assert h.workers.receivers(5) == [*losing, "a"]
    assert target == want and h.membership.get("a").slot_map_epoch == 6


async def test_untrusted_copies_leave_the_map_are_copied_afresh_and_are_then_forgotten() -> None:
    # Arrange: a and b hold every slot; a's copies of slots 0..3 are stale.
    h = Harness("a", "b")
    before = rendezvous(["a", "b"], 3)
    h.start_at(before)
    h.rb.distrust("a", [0, 1, 2, 3], replan=False)
    assert h.saved[-1][1] == {"untrusted": {"a": [0, 1, 2, 3]}, "unverified": []}

    # Act
    await h.rb.rebalance()

    # Assert: the interim leaves a out of those slots, b copies them back to a, and the
    # last map is the rendezvous one again; the pairs are forgotten and that is saved.
    interim = h.workers.published()[0]
    for s in range(SLOTS):
        holders = (interim.primary[s], interim.replica[s])
        assert holders == (("b", "") if s < 4 else (before.primary[s], before.replica[s]))
    assert [(src, dst, sl) for _, src, dst, sl, _ in h.workers.of("copy")] == [
        ("b", "a", (0, 1, 2, 3))
    ]
    assert h.rb.current.same_placement(before)
    assert h.rb.trust.untrusted == {}
    assert h.saved[-1] == (h.rb.current, {"untrusted": {}, "unverified": []})


async def test_a_trust_change_during_the_copies_skips_the_target_and_keeps_the_pairs() -> None:
    # Arrange: as above, but b's copy of slot 9 turns stale while the copies run.
    h = Harness("a", "b")
    h.start_at(rendezvous(["a", "b"], 3))
    h.rb.distrust("a", [0, 1, 2, 3], replan=False)
    h.workers.on_copy = lambda: h.rb.distrust("b", [9])

    # Act
    await h.rb.rebalance()

    # Assert: the copies made from the old plan publish nothing; the next pass re-plans
    # with every pair still untrusted, and was asked for.
    assert [m.epoch for m in h.workers.published()] == [4]  # the interim only
    assert h.rb.current.epoch == 4
    assert h.rb.trust.untrusted == {"a": {0, 1, 2, 3}, "b": {9}}
    assert not h.rb.settled.is_set()


async def test_a_restarted_worker_waits_for_its_peer_then_is_compared_restarted_first() -> None:
    # Arrange: a restarted; b, the other holder of its slots, is restored from the saved
    # registry and has not been heard from.
    h = Harness("a", "b")
    before = rendezvous(["a", "b"], 3)
    h.start_at(before)
    h.rb.worker_restarted("a")
    h.membership.get("b").restored = True
    h.workers.seqs = {"a": dict.fromkeys(range(SLOTS), 7), "b": dict.fromkeys(range(SLOTS), 7)}
    h.workers.seqs["a"][5] = 6  # a missed one write of slot 5

    # Act / Assert: nothing is asked or published while b may run another process.
    with pytest.raises(VerificationPending, match="waiting for b"):
        await h.rb.rebalance()
    assert h.workers.log == [] and h.rb.trust.unverified == {"a"}

    # Act: b heartbeats (it is the process that registered), and the pass runs again.
    h.membership.heartbeat("b", memories=0, epoch=3)
    await h.rb.rebalance()

    # Assert: a was asked before b, all its slots; its copy of slot 5 alone is untrusted and
    # copied afresh; a adopts the interim (without slot 5) first.
    seqs = h.workers.of("seqs")
    assert [n for _, n, _ in seqs] == ["a", "b"]
    assert seqs[0][2] == tuple(range(SLOTS))
    interim = h.workers.published()[0]
    assert "a" in h.workers.receivers(interim.epoch)
    assert "a" not in (interim.primary[5], interim.replica[5])
    assert all("a" in (interim.primary[s], interim.replica[s]) for s in range(SLOTS) if s != 5)
    assert [(src, dst, sl) for _, src, dst, sl, _ in h.workers.of("copy")] == [("b", "a", (5,))]
    assert h.rb.current.same_placement(before) and h.rb.trust.untrusted == {}


async def run_until_settled(h: Harness, act: Callable[[], Any]) -> None:
    """Run the loop, trigger a pass, ``act`` (may await), wait until settled, stop the loop."""
    task = asyncio.create_task(h.rb.run())
    try:
        h.rb.trigger()
        result = act()
        if asyncio.iscoroutine(result):
            await result
        await asyncio.wait_for(h.rb.settled.wait(), timeout=20)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_the_loop_replans_while_a_verification_is_pending_then_settles() -> None:
    # Arrange: a restarted and b does not answer SlotSeqs at first.
    h = Harness("a", "b")
    before = rendezvous(["a", "b"], 3)
    h.start_at(before)
    h.rb.worker_restarted("a")
    h.workers.down.add("b")

    async def b_comes_back() -> None:
        await wait_until(
            lambda: sum(1 for _, n, _ in h.workers.of("seqs") if n == "b") >= 2,
            timeout_s=20,
            what="b asked twice",
        )
        assert not h.rb.settled.is_set() and h.workers.of("map") == []
        h.workers.down.discard("b")

    # Act
    await run_until_settled(h, b_comes_back)

    # Assert: once b answered, a (level with b: both report 0) kept all its copies.
    assert h.rb.trust.unverified == set() and h.rb.trust.untrusted == {}
    assert h.membership.get("a").slot_map_epoch == h.rb.current.epoch == 4


async def test_the_loop_replans_after_a_failed_copy_and_settles() -> None:
    # Arrange: c joins a and b; the first CopySlots fails (a source died mid-way, say).
    h = Harness("a", "b")
    h.start_at(rendezvous(["a", "b"], 3))
    h.membership.register("c", "c:1", "cpu", process_id="c-1")
    failures = [unavailable("a")]

    def fail_once() -> None:
        if failures:
            raise failures.pop()

    h.workers.on_copy = fail_once

    # Act
    await run_until_settled(h, lambda: None)

    # Assert: the second pass copied and published the target.
    assert h.rb.current.same_placement(rendezvous(["a", "b", "c"], 0))
    first_attempt = h.workers.of("copy")[0]
    assert first_attempt in h.workers.of("copy")[1:]  # sent again by the next pass
    assert h.membership.get("c").slot_map_epoch == h.rb.current.epoch


async def test_laggards_get_the_current_map_and_a_failed_push_is_retried_later() -> None:
    # Arrange: epoch 4; a is current, b behind, c unverified, d behind but down, e dead.
    h = Harness("a", "b", "c", "d", "e")
    h.rb.current = rendezvous(["a", "b"], 4)
    for name, epoch in [("a", 4), ("b", 2), ("c", 1), ("d", 3), ("e", 1)]:
        h.membership.heartbeat(name, memories=0, epoch=epoch)
    h.rb.trust.restarted("c")
    h.membership.mark_dead("e")
    h.workers.down.add("d")

    # Act
    await h.rb._push_to_laggards()

    # Assert: only the live, decided laggards were sent the map; d stays behind.
    assert [(n, e) for _, n, e in h.workers.of("map")] == [("b", 4)]
    epochs = {n: h.membership.get(n).slot_map_epoch for n in "abcde"}
    assert epochs == {"a": 4, "b": 4, "c": 1, "d": 3, "e": 1}

    # Act: d is reachable again; the next push reaches it, and nobody else.
    h.workers.down.clear()
    await h.rb._push_to_laggards()

    # Assert
    assert [(n, e) for _, n, e in h.workers.of("map")] == [("b", 4), ("d", 4)]
    assert h.membership.get("d").slot_map_epoch == 4


async def test_no_laggard_push_before_a_first_map() -> None:
    h = Harness("a")

    await h.rb._push_to_laggards()

    assert h.workers.log == []


async def test_a_failed_publication_leaves_the_worker_behind_for_the_laggard_push() -> None:
    # Arrange: b cannot be reached when the target is published.
    h = Harness("a", "b")
    h.workers.down.add("b")

    # Act
    await h.rb.rebalance()

    # Assert: a has the map, b is still behind; the pass pushes again when b is back.
    assert h.membership.get("a").slot_map_epoch == h.rb.current.epoch == 1
    assert h.membership.get("b").slot_map_epoch == 0
    h.workers.down.clear()
    await h.rb._push_to_laggards()
    assert h.membership.get("b").slot_map_epoch == 1


def test_distrust_and_restart_are_saved_before_returning_and_wake_a_pass() -> None:
    h = Harness("a", "b")
    h.rb.settled.set()

    h.rb.distrust("a", [3], replan=False)

    assert h.saved[-1][1] == {"untrusted": {"a": [3]}, "unverified": []}
    assert h.rb.settled.is_set()  # no pass asked for yet

    h.rb.worker_restarted("b")

    assert h.saved[-1][1] == {"untrusted": {"a": [3]}, "unverified": ["b"]}
    assert not h.rb.settled.is_set()


def test_slot_summary_counts_only_serving_verified_trusted_copies() -> None:
    # Arrange: a and d serve; b is restored (not heard from), c restarted and unverified,
    # e dead; d's copy of slot 1 is untrusted. Slot s: (primary, replica).
    h = Harness("a", "b", "c", "d", "e")
    h.rb.current = SlotMap(
        9,
        ["a", "a", "a", "c", "d", "a", "d", "a"],
        ["d", "d", "b", "a", "a", "e", "", "d"],
    )
    h.membership.get("b").restored = True
    h.rb.trust.restarted("c")
    h.rb.trust.distrust("d", [1])
    h.membership.mark_dead("e")

    # Act
    summary = h.rb.slot_summary()

    # Assert: slots 1 (untrusted), 2 (restored), 3 (unverified), 5 (dead) and 6 (one
    # holder) have fewer than 2 counted copies; 0, 4 and 7 have two.
    assert summary == {
        "slots": 8,
        "epoch": 9,
        "replication_factor": 2,
        "under_replicated_slots": 5,
        "per_worker": {"a": (5, 2), "b": (0, 1), "c": (1, 0), "d": (2, 3), "e": (0, 1)},
    }


def test_slot_summary_wants_as_many_copies_as_there_are_live_workers_up_to_two() -> None:
    h = Harness("a", "b")
    h.rb.current = SlotMap(2, ["a", "a"], ["b", ""])
    h.membership.mark_dead("b")

    summary = h.rb.slot_summary()

    assert (summary["replication_factor"], summary["under_replicated_slots"]) == (1, 0)


def test_the_wire_map_names_dead_holders_addresses_and_a_registration_map_no_placement() -> None:
    h = Harness("a", "b")
    h.rb.current = SlotMap(7, ["a", "b"], ["b", "a"])
    h.membership.mark_dead("b")

    full, shape = h.rb.wire_map(), h.rb.wire_map(placement=False)

    assert (list(full.workers), list(full.addresses)) == (["a", "b"], ["a:1", "b:1"])
    assert full.epoch == 7 and decode(full) == h.rb.current
    assert (shape.epoch, list(shape.workers), shape.slots) == (0, [], 2)
    assert (shape.max_payload_bytes, shape.max_batch_items) == (4096, 1 << 20)


async def test_a_worker_back_from_dead_adopts_the_current_map_before_any_copy() -> None:
    # Arrange: c was declared dead (a partition) and registers again as the same process,
    # still acting on its old map; meanwhile d joins, so the pass copies.
    h = Harness("a", "b", "c")
    h.start_at(rendezvous(["a", "b", "c"], 5))
    h.membership.mark_dead("c")
    h.membership.register("c", "c:1", "cpu", process_id="c-1")
    h.membership.register("d", "d:1", "cpu", process_id="d-1")

    # Act
    await h.rb.rebalance()

    # Assert: c got the current map (epoch 5) before the first copy went out.
    first_copy = h.workers.log.index(h.workers.of("copy")[0])
    assert h.workers.log.index(("map", "c", 5)) < first_copy
    assert h.rb.current.same_placement(rendezvous(["a", "b", "c", "d"], 0))


async def test_a_publication_skips_unverified_workers_until_they_are_decided() -> None:
    # Arrange: c restarted and is not decided yet.
    h = Harness("a", "b", "c")
    h.rb.trust.restarted("c")

    # Act
    async with h.rb.map_lock:
        await h.rb._publish(rendezvous(["a", "b"], 0))

    # Assert
    assert sorted(h.workers.receivers(1)) == ["a", "b"]
    assert h.membership.get("c").slot_map_epoch == 0
