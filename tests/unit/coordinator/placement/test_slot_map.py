"""coordinator/placement/slot_map.py: the interim and target maps and the copies of ``plan()``, and
the
map's counts, under-replication and wire form."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.placement.slot_map import SlotMap, WireLimits, plan, primary_changes
from shared.memory.slots import assign_slots
from shared.proto import common_pb2

S = 64


def rendezvous(names: list[str], slots: int = S, epoch: int = 7) -> SlotMap:
    """The map ``plan`` targets for these live workers."""
    names = sorted(names)
    p, r = assign_slots(names, slots)
    return SlotMap(
        epoch,
        [names[i] if i >= 0 else "" for i in p.tolist()],
        [names[i] if i >= 0 else "" for i in r.tolist()],
    )


def copied_to(p, slot: int) -> set[str]:
    return {dst for (_, dst), slots in p.copies.items() if slot in slots}


def test_first_map_places_every_slot_and_copies_nothing() -> None:
    p = plan(SlotMap.empty(S), ["a", "b", "c"], set())

    assert p.interim.same_placement(SlotMap.empty(S))  # nobody holds data yet
    assert p.target.same_placement(rendezvous(["a", "b", "c"]))
    assert p.copies == {} and p.slots_to_copy == 0


def test_settled_map_plans_no_change() -> None:
    current = rendezvous(["a", "b", "c"])

    p = plan(current, ["c", "a", "b"], set())

    assert p.interim.same_placement(current) and p.target.same_placement(current)
    assert p.copies == {}


def test_dead_primary_promotes_its_replica_in_the_interim_map() -> None:
    current = rendezvous(["a", "b", "c"])

    p = plan(current, ["b", "c"], set())

    for s in range(S):
        holders = [h for h in (current.primary[s], current.replica[s]) if h != "a"]
        assert p.interim.primary[s] == holders[0], f"slot {s}"
        assert p.interim.replica[s] == (holders[1] if len(holders) > 1 else ""), f"slot {s}"
    assert "a" not in p.interim.primary + p.interim.replica
    assert p.target.same_placement(rendezvous(["b", "c"]))
    # With two live workers every slot needs both: a copy goes wherever one is missing.
    for s in range(S):
        missing = {p.target.primary[s], p.target.replica[s]} - {
            p.interim.primary[s],
            p.interim.replica[s],
        }
        assert copied_to(p, s) == missing, f"slot {s}"
    assert all(src != "a" for src, _ in p.copies)


def test_join_copies_only_to_the_new_holders() -> None:
    current = rendezvous(["a", "b", "c"])

    p = plan(current, ["a", "b", "c", "d"], set())

    assert p.interim.same_placement(current)  # everyone keeps serving during the copies
    assert p.target.same_placement(rendezvous(["a", "b", "c", "d"]))
    assert {dst for _, dst in p.copies} == {"d"}
    joined = [s for s in range(S) if "d" in (p.target.primary[s], p.target.replica[s])]
    assert sorted(s for slots in p.copies.values() for s in slots) == joined
    for (src, _), slots in p.copies.items():
        assert all(current.primary[s] == src for s in slots)  # copied from the primary
    # Minimal movement: a slot d does not take keeps both of its holders.
    for s in set(range(S)) - set(joined):
        assert {p.target.primary[s], p.target.replica[s]} == {
            current.primary[s],
            current.replica[s],
        }


def test_second_worker_joining_gets_a_copy_of_every_slot() -> None:
    current = rendezvous(["a"])
    assert set(current.replica) == {""}

    p = plan(current, ["a", "b"], set())

    assert p.interim.same_placement(current)
    assert p.copies == {("a", "b"): list(range(S))}


def test_no_data_worker_holds_nothing_in_the_interim_map() -> None:
    current = rendezvous(["a", "b", "c"])

    p = plan(current, ["a", "b", "c"], {"b"})

    assert "b" not in p.interim.primary + p.interim.replica
    for s in range(S):
        if current.primary[s] == "b":  # its replica stands in as primary
            assert p.interim.primary[s] == current.replica[s]
    assert p.target.same_placement(current)  # and b gets its slots back by copy
    held_by_b = [s for s in range(S) if "b" in (current.primary[s], current.replica[s])]
    assert {dst for _, dst in p.copies} == {"b"}
    assert sorted(s for slots in p.copies.values() for s in slots) == held_by_b


def test_slot_without_a_surviving_copy_starts_empty() -> None:
    current = SlotMap(3, ["a", "a", "b", "d"], ["b", "c", "c", "a"])

    p = plan(current, ["b", "c", "d"], {"c"})  # a is dead, c restarted empty

    assert p.interim.primary == ["b", "", "b", "d"] and p.interim.replica == ["", "", "", ""]
    assert all(1 not in slots for slots in p.copies.values())  # nothing to copy slot 1 from
    for (src, _), slots in p.copies.items():
        assert all(p.interim.primary[s] == src for s in slots)


def test_only_worker_dying_leaves_every_slot_empty_and_unassigned() -> None:
    p = plan(rendezvous(["a"]), [], set())

    assert p.interim.same_placement(SlotMap.empty(S))
    assert p.target.same_placement(SlotMap.empty(S))
    assert p.copies == {}


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from("abcdef"), min_size=1, max_size=6, unique=True),
    st.lists(st.sampled_from("abcdefgh"), max_size=6, unique=True),
    st.lists(st.sampled_from("abcdefgh"), max_size=3, unique=True),
    st.integers(0, 2**32 - 1),
)
def test_plan_invariants(before, alive, no_data, seed) -> None:
    """For any current map (rendezvous over some workers, then scrambled) and membership:
    the interim map only keeps live holders with data, in their old order; every target
    holder of a slot with a surviving copy either holds it in the interim map or receives a
    copy from the interim primary; the target is rendezvous over the live workers."""
    rng = np.random.default_rng(seed)
    current = rendezvous(before, slots=16)
    for s in rng.choice(16, size=4, replace=False).tolist():  # some slots out of place
        current.primary[s], current.replica[s] = current.replica[s], current.primary[s]
    no_data_set = set(no_data)

    p = plan(current, alive, no_data_set)

    live = set(alive) - no_data_set
    assert p.target.same_placement(rendezvous(alive, slots=16))
    for s in range(16):
        survivors = [h for h in (current.primary[s], current.replica[s]) if h in live]
        assert [h for h in (p.interim.primary[s], p.interim.replica[s]) if h] == survivors
        got = copied_to(p, s)
        interim = {p.interim.primary[s], p.interim.replica[s]} - {""}
        want = {p.target.primary[s], p.target.replica[s]} - {""} - interim
        assert got == (want if survivors else set()), f"slot {s}"
    for (src, dst), slots in p.copies.items():
        assert src != dst and src in live and dst in alive
        assert all(p.interim.primary[s] == src for s in slots)
        assert slots == sorted(set(slots))


def test_counts_per_worker() -> None:
    m = SlotMap(1, ["a", "a", "b", ""], ["b", "c", "a", ""])

    assert m.counts() == {"a": (2, 1), "b": (1, 1), "c": (0, 1)}


def test_under_replicated_counts_live_copies_against_rf_capped_by_live_workers() -> None:
    m = SlotMap(1, ["a", "a", "b", ""], ["b", "c", "", ""])

    assert m.under_replicated({"a", "b", "c"}, 2) == 2  # slot 2 has one copy, slot 3 none
    assert m.under_replicated({"a", "b"}, 2) == 3  # c is gone: slot 1 is down to one copy
    assert m.under_replicated({"a"}, 2) == 2  # rf capped at 1: slots 2 and 3 have no copy
    assert m.under_replicated(set(), 2) == 0
    assert rendezvous(["a", "b", "c"]).under_replicated({"a", "b", "c"}, 2) == 0
    assert rendezvous(["a"]).under_replicated({"a"}, 2) == 0


def test_primary_changes_names_the_old_primaries_that_lose_a_slot() -> None:
    old = SlotMap(1, ["a", "b", "c", ""], ["b", "a", "", ""])
    new = SlotMap(2, ["a", "a", "d", "b"], ["b", "b", "c", ""])

    assert primary_changes(old, new) == {"b", "c"}


def test_wire_form_indexes_the_sorted_worker_names() -> None:
    m = SlotMap(5, ["b", "a", ""], ["a", "", ""])

    pb = m.to_pb({"a": "h:1", "b": "h:2"}, WireLimits(max_payload_bytes=64, max_batch_items=7))

    assert (pb.epoch, pb.slots, pb.max_payload_bytes, pb.max_batch_items) == (5, 3, 64, 7)
    assert list(pb.workers) == ["a", "b"] and list(pb.addresses) == ["h:1", "h:2"]
    assert list(pb.primary) == [1, 0, -1] and list(pb.replica) == [0, -1, -1]


def test_wire_form_without_placement_carries_only_the_slot_count_and_limits() -> None:
    m = SlotMap(5, ["b", "a", ""], ["a", "", ""])

    pb = m.to_pb({"a": "h:1"}, WireLimits(max_payload_bytes=64, max_batch_items=7), placement=False)

    assert pb == common_pb2.SlotMap(slots=3, max_payload_bytes=64, max_batch_items=7)


def test_only_serving_trusted_copies_count_as_replicated() -> None:
    # Arrange: 4 slots on w0 (primary) and w1 (replica)
    m = SlotMap(epoch=3, primary=["w0"] * 4, replica=["w1"] * 4)
    alive = {"w0", "w1"}

    # Act / Assert: every copy counts; w1 not yet confirmed (restored or unverified) makes
    # every slot short; one untrusted copy makes its slot short
    assert m.under_replicated(alive, 2) == 0
    assert m.under_replicated(alive, 2, confirmed={"w0"}) == 4
    assert m.under_replicated(alive, 2, confirmed=alive, untrusted={"w1": {2}}) == 1
