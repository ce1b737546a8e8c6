"""The dashboard's snapshot and event log, built from a Cluster without HTTP or workers."""

from __future__ import annotations

import json
from pathlib import Path

from coordinator.cluster import Cluster
from coordinator.dashboard.snapshot import SnapshotBuilder, StorePoller
from coordinator.events import EventLog
from coordinator.jobs.jobs import JobState
from coordinator.placement.slot_map import SlotMap
from shared.config import CoordinatorConfig
from shared.metrics import Metrics


def _cluster(tmp_path: Path) -> Cluster:
    return Cluster(CoordinatorConfig(data_dir=str(tmp_path), metrics_port=None, slots=8), Metrics())


def test_event_log_keeps_the_last_events_newest_first() -> None:
    log = EventLog(capacity=3, clock=lambda: 100.0)
    for i in range(5):
        log.add("worker_alive", f"w{i} joined", worker=f"w{i}")
    recent = log.recent()
    assert [e["worker"] for e in recent] == ["w4", "w3", "w2"]
    assert recent[0] == {
        "seq": 5,
        "time": 100.0,
        "kind": "worker_alive",
        "message": "w4 joined",
        "worker": "w4",
    }


async def test_snapshot_shows_workers_slots_jobs_and_events(tmp_path: Path) -> None:
    cluster = _cluster(tmp_path)
    try:
        for name in ("w0", "w1", "w2"):
            cluster.register_worker(name, f"127.0.0.1:{5000 + len(name)}", "cpu")
        # w0 primary of every slot, w1 replica of the first half, none for the rest; the
        # new workers' copies verified (the rebalancer's pass does it in a running cluster)
        cluster.rebalancer.trust.unverified.clear()
        cluster.rebalancer.current = SlotMap(
            epoch=7, primary=["w0"] * 8, replica=["w1"] * 4 + [""] * 4
        )
        job = await cluster.submit('{"kind": "train", "workers": 1, "steps": 1}')
        await cluster.jobs.update(job, state=JobState.RUNNING)
        await cluster.jobs.update(
            job,
            progress={
                "step": 5,
                "steps": 20,
                "epoch": 2,
                "epochs": 4,
                "loss": 0.5,
                "test_accuracy": float("nan"),
                "samples_per_s": 900.0,
                "history": [
                    {
                        "epoch": 1,
                        "train_loss": 1.2,
                        "test_loss": 1.0,
                        "test_accuracy": 0.7,
                        "samples_per_s": 880.0,
                        "convergence": 1.9,
                    }
                ],
            },
        )
        assert cluster.membership.mark_dead("w2")
        cluster._on_membership_change()

        snap = SnapshotBuilder(cluster).build()

        json.dumps(snap, allow_nan=False)  # NaN became None: the page's JSON.parse accepts it
        assert [(w["name"], w["state"]) for w in snap["workers"]] == [
            ("w0", "ALIVE"),
            ("w1", "ALIVE"),
            ("w2", "DEAD"),
        ]
        # w2 just died: held down for 2 x heartbeat_interval_s before it may rejoin
        holddown = [w["readmit_holddown_s"] for w in snap["workers"]]
        assert holddown[:2] == [0.0, 0.0]
        assert 0 < holddown[2] <= 2 * cluster.cfg.heartbeat_interval_s
        assert snap["workers"][0]["slots_primary"] == 8
        assert snap["workers"][1]["slots_replica"] == 4
        slots = snap["slots"]
        assert slots["epoch"] == 7 and slots["workers"] == ["w0", "w1"]
        assert slots["primary"] == [0] * 8 and slots["replica"] == [1] * 4 + [-1] * 4
        assert slots["under_replicated"] == 4
        assert slots["under_replicated_slots"] == [4, 5, 6, 7]
        (j,) = snap["jobs"]
        assert j["state"] == "RUNNING" and j["fraction"] == 0.25
        assert j["test_accuracy"] is None and j["samples_per_s"] == 900.0
        assert j["history"][0]["test_accuracy"] == 0.7
        assert j["convergence"] == [[1, 1.9]]  # L_0 / L_e by epoch, for the page's chart
        kinds = [e["kind"] for e in snap["events"]]
        assert kinds[0] == "worker_dead" and snap["events"][0]["message"] == "w2 died"
        assert {"job_submitted", "job_running", "worker_alive"} <= set(kinds)
        assert snap["store"] == {"polled": False}
    finally:
        await cluster.close()


async def test_memory_job_latency_series_grows_once_per_iteration(tmp_path: Path) -> None:
    cluster = _cluster(tmp_path)
    try:
        job = await cluster.submit(
            '{"kind": "memory", "workers": 1, "memories": 100, "iterations": 10}'
        )
        builder = SnapshotBuilder(cluster)
        for it, ms in ((1, 3.0), (1, 3.0), (2, 4.5)):
            await cluster.jobs.update(
                job,
                progress={
                    "iteration": it,
                    "iterations": 10,
                    "iteration_ms": ms,
                    "histogram": [0] * 9 + [100],
                },
            )
            doc = builder.build()["jobs"][0]
        assert doc["latency_ms"] == [[1, 3.0], [2, 4.5]]
        assert doc["histogram"][-1] == 100 and doc["fraction"] == 0.2
    finally:
        await cluster.close()


async def test_store_poller_does_not_poll_an_empty_store(tmp_path: Path) -> None:
    cluster = _cluster(tmp_path)
    try:
        latest = await StorePoller(cluster).refresh()  # no worker, no memories: no fan-out
        assert latest["polled"] and latest["count"] == 0 and latest["top"] == []
    finally:
        await cluster.close()
