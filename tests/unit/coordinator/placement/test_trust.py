"""coordinator/placement/slot_trust.py (which copies a restarted worker keeps) and the per-slot
trust and
lost slots of ``plan()``."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.placement.slot_map import SlotMap, plan
from coordinator.placement.slot_trust import SlotTrust, VerificationPending

# Slot s: primary, replica.
CURRENT = SlotMap(5, ["a", "b", "a", "c", "b"], ["b", "a", "c", "", "c"])


def seqs_from(table: dict[str, dict[int, int]], asked: list[str] | None = None):
    async def seqs_of(name: str, slots: list[int]) -> list[int]:
        if asked is not None:
            asked.append(name)
        if name not in table:
            raise ConnectionError(f"{name} is down")
        return [table[name].get(s, 0) for s in slots]

    return seqs_of


def verify(trust: SlotTrust, table, live=("a", "b", "c"), confirmed=None, asked=None) -> bool:
    live_set = set(live)
    return asyncio.run(
        trust.verify(CURRENT, live_set, set(confirmed or live_set), seqs_from(table, asked))
    )


def test_restarted_copies_equal_to_the_running_holders_are_kept() -> None:
    trust = SlotTrust(5)
    trust.restarted("a")
    asked: list[str] = []

    decided = verify(trust, {"a": {0: 4, 1: 7, 2: 9}, "b": {0: 4, 1: 8}, "c": {2: 9}}, asked=asked)

    assert decided and trust.unverified == set()
    assert trust.untrusted == {"a": {1}}  # slot 1 moved on while a was away
    assert asked[0] == "a"  # the restarted worker is read before the running ones


def test_a_restarted_primary_ahead_of_its_running_replica_is_not_trusted() -> None:
    """Ahead means it applied an op it never forwarded (so never acknowledged)."""
    trust = SlotTrust(5)
    trust.restarted("a")

    verify(trust, {"a": {0: 5, 1: 3, 2: 2}, "b": {0: 4, 1: 3}, "c": {2: 2}})

    assert trust.untrusted == {"a": {0}}


def test_when_every_holder_restarted_the_highest_seq_wins() -> None:
    trust = SlotTrust(5)
    for w in "abc":
        trust.restarted(w)

    verify(trust, {"a": {0: 5, 1: 3, 2: 2}, "b": {0: 4, 1: 3, 4: 6}, "c": {2: 1, 3: 0, 4: 6}})

    assert trust.untrusted == {"b": {0}, "c": {2}}


def test_a_holder_already_distrusted_is_no_reference() -> None:
    trust = SlotTrust(5)
    trust.distrust("b", [0])
    trust.restarted("a")

    verify(trust, {"a": {0: 2, 1: 3, 2: 2}, "b": {0: 9, 1: 3}, "c": {2: 2}})

    assert trust.untrusted == {"b": {0}}  # a's slot 0 is the only trusted copy left


def test_dead_holders_are_left_out_and_unreachable_ones_are_waited_for() -> None:
    trust = SlotTrust(5)
    trust.restarted("a")

    with pytest.raises(VerificationPending, match="c did not report"):
        verify(trust, {"a": {2: 1}, "b": {}})
    with pytest.raises(VerificationPending, match="waiting for c to register"):
        verify(trust, {"a": {2: 1}, "b": {}, "c": {2: 5}}, confirmed={"a", "b"})
    assert trust.unverified == {"a"}

    verify(trust, {"a": {2: 1}, "b": {}}, live=("a", "b"))  # c was declared dead

    assert trust.unverified == set() and trust.untrusted == {}


def test_resolve_forgets_only_what_the_plan_dealt_with_and_the_doc_round_trips() -> None:
    trust = SlotTrust(4)
    trust.distrust("a", [1, 2])
    planned = trust.snapshot()
    trust.distrust("a", [3])
    trust.restarted("b")

    assert trust.resolve(planned)
    assert trust.untrusted == {"a": {3}}
    again = SlotTrust(4)
    again.load_doc(trust.to_doc())
    assert (again.untrusted, again.unverified) == ({"a": {3}}, {"b"})
    old = SlotTrust(4)
    old.load_doc({"no_data": ["c"]})  # saved by an earlier version: whole workers
    assert old.untrusted == {"c": {0, 1, 2, 3}}


def test_plan_drops_only_untrusted_pairs_and_copies_them_back() -> None:
    current = SlotMap(1, ["a", "b", "c", "a"], ["b", "c", "a", "c"])

    p = plan(current, ["a", "b", "c"], set(), untrusted={"a": {0}, "c": {3}})

    assert p.interim.primary == ["b", "b", "c", "a"]
    assert p.interim.replica == ["", "c", "a", ""]
    for s in range(4):  # every target holder without a trusted copy gets one
        missing = {p.target.primary[s], p.target.replica[s]} - {
            p.interim.primary[s],
            p.interim.replica[s],
            "",
        }
        got = {dst for (src, dst), slots in p.copies.items() if s in slots}
        assert got == missing, f"slot {s}"
    for (src, _), slots in p.copies.items():
        assert all(p.interim.primary[s] == src for s in slots)


def test_plan_keeps_a_lost_slot_with_its_dead_holders() -> None:
    current = SlotMap(1, ["a", "a", "b", "c"], ["b", "c", "c", ""])

    p = plan(current, ["c"], set(), untrusted={"c": {1}}, keep_lost=True)

    # slot 0: a and b dead; slot 1: a dead, c stale; slots 2 and 3: c live.
    assert p.lost == [0, 1]
    assert (p.interim.primary, p.interim.replica) == (["a", "a", "c", "c"], ["b", "", "", ""])
    assert (p.target.primary[:2], p.target.replica[:2]) == (["a", "a"], ["b", ""])
    assert all(0 not in s and 1 not in s for s in p.copies.values())
    without = plan(current, ["c"], set(), untrusted={"c": {1}})
    assert without.lost == [] and without.interim.primary == ["", "", "c", "c"]
