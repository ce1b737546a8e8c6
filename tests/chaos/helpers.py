"""Helpers for chaos tests: real local clusters with fast failure detection, a writer that
records only acknowledged operations, and a full dump of the store."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np

from shared.cli.local_cluster import LocalCluster
from shared.client import Client
from shared.proto import worker_pb2_grpc
from shared.rpc import channel
from tests.integration.memory_helpers import dump_worker
from tests.memory_reference import ReferenceStore

FAST = "heartbeat_interval_s: 0.2\nheartbeat_timeout_s: 1.0\ncheckpoint_every_steps: 20\n"


def make_cluster(
    tmp_path: Path, workers: int = 3, worker_args: list[str] | None = None, extra: str = ""
) -> LocalCluster:
    """A LocalCluster (not started) whose coordinator detects failures within ~1 s.

    ``extra``: more lines of the coordinator's YAML config.
    """
    cfg = tmp_path / "coordinator.yaml"
    cfg.write_text(FAST + extra)
    return LocalCluster(
        workers,
        data_dir=tmp_path / "cluster",
        log_dir=tmp_path / "logs",
        coordinator_args=["--config", str(cfg)],
        worker_args=worker_args,
    )


class Writer:
    """Reinforces (and upserts new ids) continuously; records only acknowledged ops."""

    def __init__(self, client: Client, ref: ReferenceStore, ids: np.ndarray) -> None:
        self.client, self.ref, self.ids = client, ref, ids
        self.acked = 0
        self.failures: list[str] = []
        self.latencies_s: list[float] = []
        self._stop = asyncio.Event()
        self._rng = np.random.default_rng(11)
        self._next_id = int(ids.max()) + 1

    async def run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                if self.acked % 5 == 4:
                    new = np.arange(self._next_id, self._next_id + 1000, dtype=np.uint64)
                    s = self._rng.random(1000, dtype=np.float32)
                    await self.client.upsert(new, s)
                    self.ref.upsert(new, s)
                    self._next_id += 1000
                else:
                    batch = self._rng.choice(self.ids, size=5000)
                    boosts = self._rng.random(5000, dtype=np.float32) * 0.01
                    await self.client.reinforce(batch, boosts)
                    self.ref.reinforce(batch, boosts)
            except Exception as exc:  # the tests assert there are none
                self.failures.append(str(exc))
                await asyncio.sleep(0.05)
                continue
            self.latencies_s.append(time.perf_counter() - t0)
            self.acked += 1

    def stop(self) -> None:
        self._stop.set()


async def wait_for(predicate, timeout_s: float, what: str) -> None:
    """Poll an async predicate until true; AssertionError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


async def fully_replicated(client: Client, workers: int) -> bool:
    s = await client.status()
    alive = [w for w in s["workers"] if w["state"] == "ALIVE"]
    return (
        len(alive) == workers
        and s["replication_factor"] == min(2, workers)
        and s["under_replicated_slots"] == 0
    )


class MapMoved(Exception):
    """The slot map changed while the workers were dumped: the dumps are not one epoch's."""


async def dump_store_once(client: Client) -> dict[int, float]:
    """{id: strength} of every memory, reading each slot from its primary and checking the
    replica holds the very same copy.

    Raises:
        MapMoved: the map's epoch after the dump is not the one read before it (a copy landed
            or a holder changed between two workers' dumps, so they are compared against the
            wrong map: not a divergence).
        AssertionError: two copies of a slot differ within one epoch.
    """
    m = await client._router.slot_map(refresh=True)
    dumps = {}
    for name, address in zip(m.workers, m.addresses, strict=True):
        async with channel(address) as ch:
            dumps[name] = await dump_worker(worker_pb2_grpc.WorkerStub(ch))
    after = await client._router.slot_map(refresh=True)
    if after.epoch != m.epoch:
        raise MapMoved(f"map moved from epoch {m.epoch} to {after.epoch} during the dump")
    out: dict[int, float] = {}
    for s in range(m.slots):
        p, r = m.primary[s], m.replica[s]
        primary = dumps[m.workers[p]].get(s, {}) if p >= 0 else {}
        if r >= 0:
            assert dumps[m.workers[r]].get(s, {}) == primary, (
                f"slot {s}: copies differ at epoch {m.epoch}"
            )
        out.update(primary)
    return out


async def dump_store(client: Client, timeout_s: float = 60.0) -> dict[int, float]:
    """``dump_store_once``, again while the map moves (for up to ``timeout_s`` seconds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await dump_store_once(client)
        except MapMoved:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


def assert_matches(store: dict[int, float], ref: ReferenceStore, id_below: int) -> None:
    """The store's memories with id < id_below equal the reference bit for bit."""
    ref_ids, ref_s = ref.items()
    got = {i: v for i, v in store.items() if i < id_below}
    print(f"store {len(store)} memories, {len(got)} below {id_below}, reference {len(ref_ids)}")
    missing = set(ref_ids.tolist()) - set(got)
    extra = set(got) - set(ref_ids.tolist())
    assert not missing and not extra, (
        f"ids differ from the acknowledged writes: {len(missing)} missing "
        f"(e.g. {sorted(missing)[:3]}), {len(extra)} unexpected (e.g. {sorted(extra)[:3]})"
    )
    values = np.array([got[i] for i in ref_ids.tolist()], np.float32)
    bad = np.flatnonzero(values != ref_s)
    assert len(bad) == 0, f"{len(bad)} strengths differ from the acknowledged writes"
