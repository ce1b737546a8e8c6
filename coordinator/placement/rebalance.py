"""Apply slot-map changes to the workers.

Publish the interim map, copy slot data to new holders (copy, then switch), publish the
target map.

Runs one rebalance at a time; a membership change during one triggers another. Map
publication and bulk memory operations exclude each other through ``map_lock``, so a bulk
decay never straddles two epochs. Which copies are data is decided per (worker, slot) by
``coordinator/placement/slot_trust.py``: a pass first compares restarted workers' copies with the
other holders', and plans without the untrusted ones.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from coordinator.events import EventLog
from coordinator.placement.membership import Membership
from coordinator.placement.slot_map import (
    SlotMap,
    WireLimits,
    fence_moving_primaries,
    plan,
    primary_changes,
)
from coordinator.placement.slot_trust import SlotTrust, VerificationPending
from shared.logging import get_logger
from shared.metrics import Metrics
from shared.proto import common_pb2, worker_pb2
from shared.rpc.peers import WorkerClients

log = get_logger(__name__)


class Rebalancer:
    """Owns the published slot map and moves the cluster toward rendezvous placement."""

    def __init__(
        self,
        slots: int,
        membership: Membership,
        clients: WorkerClients,
        metrics: Metrics,
        rpc_timeout_s: float,
        limits: WireLimits,
        on_change: Callable[[], None] | None = None,
        *,
        copy_chunk_memories: int,
        copy_pause_factor: float,
    ) -> None:
        """Start from an empty map at epoch 0 (``Cluster`` restores a saved one).

        Args:
            slots: number of hash slots, a power of two.
            membership: the live, draining and dead workers.
            clients: channels to the workers.
            metrics: ``slot_map_epoch`` is set on every publication, ``slot_copy_requests``
                counts the CopySlots requests answered.
            rpc_timeout_s: deadline of each worker call, seconds (copies get at least 60).
            limits: the request limits every published map carries.
            on_change: called after every publication.
            copy_chunk_memories: about how many memories one CopySlots request carries
                (``copy_chunk_memories``), count, >= 1. The source holds its writes to the
                copied slots while it snapshots and sends them and the target imports them
                (at 10M memories, 64 slots per request held every write ~0.5 s), but each
                request also costs the target a pass over its whole store, so requests
                should not be much smaller either.
            copy_pause_factor: after each copy request, wait this many times as long as it
                took before the next one of the pair (``copy_pause_factor``), >= 0.
        """
        self.current = SlotMap.empty(slots)
        self.map_lock = asyncio.Lock()
        self.trust = SlotTrust(slots)
        self._membership = membership
        self._clients = clients
        self._metrics = metrics
        self._timeout_s = rpc_timeout_s
        self.limits = limits
        self._wake = asyncio.Event()
        self._on_change = on_change
        self.events: EventLog | None = None  # promotions and copies, for people (dashboard)
        self.settled = asyncio.Event()  # set while the map matches the membership
        self.copies_total = 0  # slots copied by completed passes (tests and logs)
        self._copy_chunk_memories = copy_chunk_memories
        self._copy_pause_factor = copy_pause_factor
        self.persist: Callable[[SlotMap, dict[str, object]], None] | None = None
        # The replay tables every wire map lists (``coordinator/memory/tables.py`` sets it).
        self.tables: Callable[[], list[common_pb2.TableSpec]] = list

    def trigger(self) -> None:
        """Plan again soon (membership or trust changed)."""
        self.settled.clear()
        self._wake.set()

    def worker_restarted(self, name: str) -> None:
        """Hold back a new or restarted worker's map until its copies are checked.

        A worker came back as a new process, or joined for the first time, either way with
        whatever its data dir holds: it gets no map until its copies are compared with the
        other holders' (saved before returning).
        """
        self.trust.restarted(name)
        self._save()
        self.trigger()

    def distrust(self, name: str, slots: list[int] | None = None, replan: bool = True) -> None:
        """Stop treating ``name``'s copies of ``slots`` (None: all) as data, and re-plan.

        The change is saved before returning.

        Args:
            name: the worker.
            slots: its copies concerned; None for all.
            replan: re-plan now; False when the caller triggers it later (e.g. once a
                probe decided whether the worker is dead, so one pass plans for both).
        """
        self.trust.distrust(name, slots)
        self._save()
        if replan:
            self.trigger()

    def _save(self) -> None:
        if self.persist is not None:
            self.persist(self.current, self.trust.to_doc())

    async def run(self) -> None:
        """Rebalance whenever triggered; push the map to workers that report an old epoch."""
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=0.5)
            except TimeoutError:
                await self._push_to_laggards()
                continue
            self._wake.clear()
            try:
                await self.rebalance()
            except VerificationPending as exc:
                log.info("rebalance_waiting", reason=str(exc))
                await asyncio.sleep(0.2)
                self._wake.set()
            except Exception as exc:  # a worker died mid-way: plan again from the new state
                log.warning("rebalance_failed", error=f"{type(exc).__name__}: {exc}")
                if not self._wake.is_set():  # nothing new (e.g. a death) to plan with yet
                    await asyncio.sleep(0.2)
                self._wake.set()
            else:
                if not self._wake.is_set():
                    self.settled.set()

    async def rebalance(self) -> None:
        """One pass: decide restarted workers' copies, interim map, copies, target map.

        Raises:
            VerificationPending: a restarted worker's copies cannot be decided yet.
        """
        t0 = time.perf_counter()
        verified = await self._verify()
        # A worker back from DEAD (a partition healed) may still act on the map it had: it
        # must adopt the current one before copies reach it, or it refuses their forwards
        # as the primary it believes it is, each refusal distrusts it and re-plans, and the
        # pass never gets to publish (nor to its laggard push at the end) while writes flow.
        # A worker verified just now gets the interim map first instead (below).
        if not verified:
            await self._push_to_laggards()
        async with self.map_lock:
            alive = [w.name for w in self._membership.alive()]
            draining = {w.name for w in self._membership.draining()}
            if self.trust.unverified & (set(alive) | draining):
                raise VerificationPending("a worker restarted during this pass")
            version, untrusted = self.trust.version, self.trust.snapshot()
            p = plan(self.current, alive, set(), draining, untrusted=untrusted, keep_lost=True)
            # A worker just verified adopts the interim map first: it holds exactly its
            # trusted copies there, so it drops the rest of what it reloaded before a later
            # map can give it a slot to fill by copy (or a slot that starts empty).
            if verified or not p.interim.same_placement(self.current):
                self._note_promotions(self.current, p.interim)
                await self._publish(p.interim)
        copied = await self._copy(p.copies)
        if p.copies and self.events is not None:
            self.events.add(
                "slots_copied",
                f"{p.slots_to_copy} slot copies made ({copied} memories)",
                slots=p.slots_to_copy,
                memories=copied,
            )
        if not p.target.same_placement(self.current):
            async with self.map_lock:
                if self.trust.version != version:
                    return  # copies went stale or a worker restarted: re-plan (woken)
                fence = fence_moving_primaries(self.current, p.target)
                if fence is not None:
                    await self._publish(fence)
                await self._publish(p.target)
        if self.trust.resolve(untrusted):
            self._save()
        await self._push_to_laggards()  # e.g. a restarted worker whose copies all checked out
        self.copies_total += p.slots_to_copy
        if p.copies or not p.target.same_placement(p.interim):
            log.info(
                "rebalanced",
                epoch=self.current.epoch,
                workers=len(alive),
                slots_copied=p.slots_to_copy,
                memories_copied=copied,
                slots_lost=len(p.lost),
                seconds=round(time.perf_counter() - t0, 3),
            )

    def _note_promotions(self, old: SlotMap, new: SlotMap) -> None:
        """Record, per new primary, the slots whose replica ``new`` makes primary."""
        if self.events is None:
            return
        promoted: dict[str, int] = {}
        for p_old, r_old, p_new in zip(old.primary, old.replica, new.primary, strict=True):
            if p_old and p_new != p_old and p_new == r_old:
                promoted[p_new] = promoted.get(p_new, 0) + 1
        for name, n in sorted(promoted.items()):
            self.events.add(
                "replicas_promoted", f"{name}: {n} replicas promoted", worker=name, slots=n
            )

    async def _verify(self) -> bool:
        """Compare restarted workers' copies with the other holders'; True if one was decided.

        See ``SlotTrust.verify``.
        """
        live = self._membership.alive() + self._membership.draining()
        confirmed = {w.name for w in live if not w.restored}

        async def seqs_of(name: str, slots: list[int]) -> list[int]:
            w = self._membership.get(name)
            if w is None:
                raise RuntimeError(f"{name} is unknown")
            reply = await self._clients.stub(name, w.address).SlotSeqs(
                worker_pb2.SlotSeqsRequest(slots=slots), timeout=self._timeout_s
            )
            return list(reply.seqs)

        if not await self.trust.verify(self.current, {w.name for w in live}, confirmed, seqs_of):
            return False
        self._save()
        log.info(
            "restarted_workers_checked",
            untrusted={n: len(s) for n, s in self.trust.untrusted.items()},
        )
        return True

    async def _copy(self, copies: dict[tuple[str, str], list[int]]) -> int:
        """Copy each (source, target) pair's slots, pairs at once, chunks in turn.

        A pair's slots go in requests of about ``copy_chunk_memories`` memories (by the
        source's last reported count per slot held; at least one slot each), with a pause of
        ``copy_pause_factor`` times a request's duration after it, so the writes the source
        holds while it sends a chunk wait one chunk at most and then get through, rather
        than stalling for the whole copy (Ceph's osd_recovery_sleep does the same): writes
        run at least factor / (1 + factor) of the time, and the copy takes 1 + factor times
        as long.

        Returns:
            Memories copied.
        """

        async def one(src: str, dst: str, slots: list[int]) -> int:
            s, d = self._membership.get(src), self._membership.get(dst)
            if s is None or d is None:
                raise RuntimeError(f"copy {src} -> {dst}: worker unknown")
            copied, per = 0, self._slots_per_copy(src, s.memories)
            loop, took_s = asyncio.get_running_loop(), 0.0
            for i in range(0, len(slots), per):
                await asyncio.sleep(took_s * self._copy_pause_factor)
                t0 = loop.time()
                reply = await self._clients.stub(src, s.address).CopySlots(
                    worker_pb2.CopySlotsRequest(
                        epoch=self.current.epoch,
                        slots=slots[i : i + per],
                        target=dst,
                        target_address=d.address,
                    ),
                    timeout=max(self._timeout_s, 60.0),
                )
                copied += int(reply.memories)
                self._metrics.slot_copy_requests.inc()
                took_s = loop.time() - t0
            return copied

        counts = await asyncio.gather(*(one(s, d, sl) for (s, d), sl in copies.items()))
        return sum(counts)

    def _slots_per_copy(self, src: str, memories: int) -> int:
        """Slots per CopySlots request from ``src``: ~``copy_chunk_memories`` memories.

        Args:
            src: the source worker.
            memories: the memories it last reported holding as primary (its heartbeats
                count those only), so the average is over its primary slots.
        """
        primary, _ = self.current.counts().get(src, (0, 0))
        per_slot = memories / max(primary, 1)
        return max(1, int(self._copy_chunk_memories / max(per_slot, 1.0)))

    async def publish_same(self) -> None:
        """Publish the current placement again under the next epoch; caller holds ``map_lock``.

        For a change that travels in the map but moves no slot (the tables). Before the
        first map (epoch 0) nothing is published: the first one carries it.
        """
        if self.current.epoch == 0:
            return
        await self._publish(self.current)

    async def _publish(self, new: SlotMap) -> None:
        """Bump the epoch and push the map to the live workers; caller holds ``map_lock``.

        First to workers losing a primary role (they stop accepting writes for it), then to
        everyone else.
        """
        old = self.current
        new = SlotMap(old.epoch + 1, list(new.primary), list(new.replica))
        self.current = new
        self._save()
        self._metrics.slot_map_epoch.set(new.epoch)
        first = primary_changes(old, new)
        alive = {
            w.name: w
            for w in self._membership.alive() + self._membership.draining()
            if w.name not in self.trust.unverified
        }  # those get a map once decided
        pb = self.wire_map()
        for group in (first & set(alive), set(alive) - first):
            results = await asyncio.gather(
                *(
                    self._clients.stub(n, alive[n].address).ApplySlotMap(
                        pb, timeout=self._timeout_s
                    )
                    for n in sorted(group)
                ),
                return_exceptions=True,
            )
            for n, r in zip(sorted(group), results, strict=True):
                if isinstance(r, BaseException):
                    log.warning("slot_map_push_failed", worker=n, epoch=new.epoch, error=str(r))
                else:
                    alive[n].slot_map_epoch = new.epoch
        if self._on_change is not None:
            self._on_change()

    async def _push_to_laggards(self) -> None:
        """Re-send the current map to live workers whose heartbeat reports an older epoch."""
        if self.current.epoch == 0:
            return
        async with self.map_lock:
            late = [
                w
                for w in self._membership.alive()
                if w.slot_map_epoch != self.current.epoch and w.name not in self.trust.unverified
            ]
            if not late:
                return
            pb = self.wire_map()
            for w in late:
                try:
                    await self._clients.stub(w.name, w.address).ApplySlotMap(
                        pb, timeout=self._timeout_s
                    )
                    w.slot_map_epoch = self.current.epoch
                except Exception as exc:
                    log.warning("slot_map_push_failed", worker=w.name, error=str(exc))

    async def wait_settled(self, timeout_s: float) -> None:
        """Wait until the published map matches the membership and no slot lacks a copy.

        Polls every 50 ms (the settled event is cleared and set again as maps come and go, and
        under-replication is a property of the map, not an event).

        Args:
            timeout_s: the longest wait, seconds.

        Raises:
            TimeoutError: not within ``timeout_s``; the message gives the slots still
                under-replicated (the caller maps it to its own error).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            summary = self.slot_summary()
            if (
                self.settled.is_set()
                and summary["epoch"] > 0
                and summary["under_replicated_slots"] == 0
            ):
                return
            if loop.time() > deadline:
                raise TimeoutError(
                    f"the slot map did not settle within {timeout_s:g} s "
                    f"({summary['under_replicated_slots']} slots under-replicated)"
                )
            await asyncio.sleep(0.05)

    def slot_summary(self) -> dict[str, Any]:
        """Cluster-wide slot figures of the current map and per-worker slot counts.

        Returns:
            ``slots``, ``epoch``, ``replication_factor`` (2, or fewer live workers),
            ``under_replicated_slots`` (fewer serving, trusted copies than that: a copy on a
            worker restored and not heard from, or restarted and unverified, does not
            count) and ``per_worker``
            (name -> (slots as primary, slots as replica)).
        """
        current = self.current
        live = self._membership.alive()
        alive = {w.name for w in live}
        # Copies count once they serve: not on a worker restored from the saved registry and
        # not heard from yet (the map may still name its old process's address), nor on a
        # restarted one not yet verified, nor an untrusted copy (being copied afresh). Else
        # the status said RF 2 after a full restart while the map still pointed at dead
        # processes (issue 20 #1: `make test-restart-loop`).
        confirmed = {w.name for w in live if not w.restored} - self.trust.unverified
        return {
            "slots": current.slots,
            "epoch": current.epoch,
            "replication_factor": min(2, len(alive)),
            "under_replicated_slots": current.under_replicated(
                alive, 2, confirmed, self.trust.snapshot()
            ),
            "per_worker": current.counts(),
        }

    def wire_map(self, *, placement: bool = True) -> common_pb2.SlotMap:
        """The current map as workers and clients receive it (``SlotMap.to_pb``).

        Args:
            placement: False for the slot count and limits only (a registration reply).
        """
        pb = self.current.to_pb(self._addresses(), self.limits, placement=placement)
        pb.tables.extend(self.tables())
        return pb

    def _addresses(self) -> dict[str, str]:
        """Every known worker's address (a lost slot's holders may be dead)."""
        return {w.name: w.address for w in self._membership.all()}
