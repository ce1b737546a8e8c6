"""Which copies of which slots the coordinator trusts, per (worker, slot).

A copy stops being trusted when its primary reports that it could not update it, or when
its worker restarts behind: a restarted worker (a new process id) reloads its data dir and
is *unverified* until each slot it holds in the current map is compared, by sequence
number, with the slot's other live holder. A copy equal to the running holder's is trusted
as it is (it missed nothing: that is the catch-up, no data moves); any other is untrusted,
leaves the map and is copied afresh. When every live holder of a slot restarted (a full
cluster restart), the highest seq wins: the primary's stream is a prefix order, so the
holder that applied more has everything the others have.

Unverified workers get no slot map until decided, so they never serve stale data. The
state is saved with the slot map (``coordinator/persistence.py``) before a report is
answered, so a restarted coordinator keeps distrusting what it distrusted.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable

from coordinator.placement.slot_map import SlotMap

# Ask a worker for the seqs of some slots: (worker, slots) -> seqs (raising on failure).
SeqSource = Callable[[str, list[int]], Awaitable[list[int]]]


class VerificationPending(Exception):
    """A restarted worker's copies cannot be decided yet.

    Another holder of one of its slots did not answer (it may be restarting too, or about to be
    declared dead).
    """


class SlotTrust:
    """Untrusted (worker, slot) pairs and unverified (restarted) workers."""

    def __init__(self, slots: int) -> None:
        """Every copy trusted, every worker verified, for a map of ``slots`` slots."""
        self.slots = slots
        self.untrusted: dict[str, set[int]] = {}
        self.unverified: set[str] = set()
        self.version = 0  # bumped on every change: a plan made before is out of date

    def distrust(self, name: str, slots: Iterable[int] | None = None) -> None:
        """Stop trusting ``name``'s copies of ``slots`` (None: all of them)."""
        chosen = set(range(self.slots)) if slots is None else set(slots)
        self.untrusted.setdefault(name, set()).update(chosen)
        self.version += 1

    def restarted(self, name: str) -> None:
        """Mark ``name`` unverified: its copies are compared before it gets a map."""
        self.unverified.add(name)
        self.version += 1

    def snapshot(self) -> dict[str, set[int]]:
        """A copy of the untrusted pairs (what a plan is made with)."""
        return {n: set(s) for n, s in self.untrusted.items() if s}

    def resolve(self, planned: dict[str, set[int]]) -> bool:
        """Forget pairs a completed rebalance dealt with; True if anything changed.

        They left the map or were copied afresh.
        """
        changed = False
        for name, slots in planned.items():
            left = self.untrusted.get(name, set()) - slots
            changed |= left != self.untrusted.get(name)
            if left:
                self.untrusted[name] = left
            else:
                self.untrusted.pop(name, None)
        return changed

    async def verify(
        self, current: SlotMap, live: set[str], confirmed: set[str], seqs_of: SeqSource
    ) -> bool:
        """Decide the copies of every live unverified worker; return True if any was decided.

        Args:
            current: the published map (whose holders are compared).
            live: workers alive or draining.
            confirmed: live workers known to run the process that registered with this
                coordinator (not merely restored from its database).
            seqs_of: asks a worker for its seqs of some slots.

        Raises:
            VerificationPending: a holder to compare with did not answer, or is a restored
                record whose process has not shown up yet; retry later.
        """
        todo = self.unverified & live
        if not todo:
            return False
        check: dict[int, list[str]] = {}
        for s in range(current.slots):
            holders = [h for h in (current.primary[s], current.replica[s]) if h in live]
            if any(h in todo for h in holders):
                check[s] = holders
        ask: dict[str, list[int]] = defaultdict(list)
        for s, holders in check.items():
            for h in holders:
                ask[h].append(s)
        waiting = sorted(h for h in ask if h not in confirmed)
        if waiting:
            raise VerificationPending(f"waiting for {', '.join(waiting)} to register")
        # The restarted first: a running primary's seqs only grow, so reading them last
        # never makes a restarted copy that is level with it look ahead of it.
        seq: dict[tuple[str, int], int] = {}
        for group in (
            [h for h in ask if h in self.unverified],
            [h for h in ask if h not in self.unverified],
        ):
            replies = await asyncio.gather(
                *(seqs_of(h, ask[h]) for h in group), return_exceptions=True
            )
            for h, r in zip(group, replies, strict=True):
                if isinstance(r, BaseException):
                    raise VerificationPending(f"{h} did not report its seqs: {r}") from None
                seq.update(((h, s), q) for s, q in zip(ask[h], r, strict=True))
        for s, holders in check.items():
            self._decide(s, holders, seq)
        self.unverified -= todo
        self.version += 1
        return True

    def _decide(self, s: int, holders: list[str], seq: dict[tuple[str, int], int]) -> None:
        """Untrust restarted copies of slot ``s`` that differ from the reference seq.

        The reference is the running holder's seq, or the highest among restarted ones when
        none runs.
        """
        candidates = [h for h in holders if s not in self.untrusted.get(h, ())]
        running = [h for h in candidates if h not in self.unverified]
        if not candidates:
            return
        reference = max(seq[(h, s)] for h in (running or candidates))
        for h in candidates:
            if h in self.unverified and seq[(h, s)] != reference:
                self.untrusted.setdefault(h, set()).add(s)

    def to_doc(self) -> dict[str, object]:
        """The state as JSON-able data (saved with the slot map; ``load_doc`` reads it)."""
        return {
            "untrusted": {n: sorted(s) for n, s in self.untrusted.items() if s},
            "unverified": sorted(self.unverified),
        }

    def load_doc(self, doc: dict[str, object]) -> None:
        """Restore ``to_doc``'s output (or an older ``no_data`` list: whole workers)."""
        untrusted = doc.get("untrusted") or {}
        assert isinstance(untrusted, dict)
        self.untrusted = {str(n): set(s) for n, s in untrusted.items()}
        for name in doc.get("no_data") or []:  # type: ignore[attr-defined]
            self.distrust(str(name))
        self.unverified = set(doc.get("unverified") or [])  # type: ignore[call-overload]
