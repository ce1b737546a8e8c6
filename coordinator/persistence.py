"""The coordinator's durable state: slot map, worker registry and jobs, in SQLite.

The database is ``<data_dir>/coordinator.db`` (WAL journal).

Written on every change that matters after a crash (a published slot map, a registration, a
job state change); read once at start. Training progress itself lives in checkpoint files
(``coordinator.training.train_job``); a memory job's (loaded, iterations completed) lives here.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coordinator.jobs.jobs import JobRecord, JobState
from coordinator.placement.slot_map import SlotMap
from shared.config import job_spec_from_json
from shared.private_files import private_dir, touch_private

_SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS workers (
    name TEXT PRIMARY KEY, address TEXT NOT NULL, device TEXT NOT NULL, process_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, spec_json TEXT NOT NULL, state TEXT NOT NULL,
    result_json TEXT, error TEXT NOT NULL, created_at REAL NOT NULL, started_at REAL NOT NULL,
    finished_at REAL NOT NULL, workers_json TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS job_owners (job_id TEXT PRIMARY KEY, owner TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS job_crashes (job_id TEXT PRIMARY KEY, crashes INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS worker_train_devices (
    name TEXT PRIMARY KEY, train_device TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS memory_progress (
    job_id TEXT PRIMARY KEY, loaded INTEGER NOT NULL, iterations INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS job_pacing (
    job_id TEXT PRIMARY KEY, granted INTEGER NOT NULL, finish INTEGER NOT NULL
);
"""

# A job RUNNING when the coordinator crashed this many times in a row is not run again.
CRASHES_BEFORE_FAILING = 2
CRASHED_TWICE = (
    "crashed the coordinator twice: it was running at two coordinator crashes in a row, "
    "so it is not run again (submit it anew to retry)"
)


@dataclass
class SavedWorker:
    """A worker's registration as saved (what ``Membership.register`` is called with)."""

    name: str
    address: str
    device: str
    process_id: str
    train_device: str = "cpu"


class StateStore:
    """SQLite-backed persistence; every write commits (a few hundred microseconds)."""

    def __init__(self, data_dir: str | Path) -> None:
        """Open (or create) ``<data_dir>/coordinator.db``; note whether the last run crashed."""
        path = Path(data_dir) / "coordinator.db"
        private_dir(path.parent)
        # 0600 before SQLite opens it: its -wal and -shm files take the database's mode
        touch_private(path)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        # Whether the previous process stopped cleanly (``mark_clean_stop``); from now on
        # this process counts as crashed until it, too, stops cleanly.
        self.previous_crashed = self._get("clean_stop") is False
        self._put("clean_stop", False)
        self.crashed_twice: list[str] = []  # jobs ``load_jobs`` failed for that reason

    def mark_clean_stop(self) -> None:
        """Record a graceful stop: jobs left RUNNING are resumed without counting a crash."""
        self._put("clean_stop", True)

    def close(self) -> None:
        """Close the database."""
        self._db.close()

    # -- slot map -------------------------------------------------------------------------

    def save_slot_map(self, m: SlotMap, trust: dict[str, Any]) -> None:
        """Save the published map with the trust state (``SlotTrust.to_doc``)."""
        doc = {"epoch": m.epoch, "primary": m.primary, "replica": m.replica, **trust}
        self._put("slot_map", doc)

    def load_slot_map(self, slots: int) -> tuple[SlotMap, dict[str, Any]] | None:
        """The saved map and trust state, or None (also when its slot count differs)."""
        doc = self._get("slot_map")
        if doc is None or len(doc["primary"]) != slots:
            return None
        return SlotMap(doc["epoch"], doc["primary"], doc["replica"]), doc

    # -- replay tables ----------------------------------------------------------------------

    def save_tables(self, doc: dict[str, Any]) -> None:
        """Save the replay tables (``coordinator/memory/tables.py``'s ``Tables.to_doc``)."""
        self._put("tables", doc)

    def load_tables(self) -> dict[str, Any] | None:
        """The saved replay tables' document, or None."""
        doc = self._get("tables")
        return None if doc is None else dict(doc)

    # -- workers --------------------------------------------------------------------------

    def save_worker(
        self, name: str, address: str, device: str, process_id: str, train_device: str = "cpu"
    ) -> None:
        """Save (or replace) a worker's registration."""
        self._db.execute(
            "INSERT OR REPLACE INTO workers VALUES (?, ?, ?, ?)",
            (name, address, device, process_id),
        )
        # A separate table: databases of earlier versions need no migration.
        self._db.execute(
            "INSERT OR REPLACE INTO worker_train_devices VALUES (?, ?)", (name, train_device)
        )

    def delete_worker(self, name: str) -> None:
        """Forget a worker's registration (``coordinator/forget.py``)."""
        self._db.execute("DELETE FROM workers WHERE name = ?", (name,))
        self._db.execute("DELETE FROM worker_train_devices WHERE name = ?", (name,))

    def load_workers(self) -> list[SavedWorker]:
        """Every saved worker registration (train device ``cpu`` when none was saved)."""
        rows = self._db.execute(
            "SELECT w.name, w.address, w.device, w.process_id, COALESCE(d.train_device, 'cpu') "
            "FROM workers w LEFT JOIN worker_train_devices d ON d.name = w.name"
        )
        return [SavedWorker(*r) for r in rows]

    # -- jobs -----------------------------------------------------------------------------

    def save_job(self, job: JobRecord) -> None:
        """Save a job's spec, state, result and timestamps (unix seconds)."""
        self._db.execute(
            "INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                job.job_id,
                job.seq,
                job.spec_json,
                job.state.value,
                json.dumps(job.result) if job.result is not None else None,
                job.error,
                job.created_at,
                job.started_at,
                job.finished_at,
                json.dumps(job.workers),
            ),
        )
        if job.owner:  # a separate table: databases of earlier versions need no migration
            self._db.execute(
                "INSERT OR IGNORE INTO job_owners VALUES (?, ?)", (job.job_id, job.owner)
            )

    def delete_jobs(self, job_ids: list[str]) -> None:
        """Forget jobs (retention): their rows in every job table."""
        rows = [(j,) for j in job_ids]
        for table in ("jobs", "job_owners", "job_crashes", "memory_progress", "job_pacing"):
            self._db.executemany(f"DELETE FROM {table} WHERE job_id = ?", rows)

    def load_jobs(self) -> list[JobRecord]:
        """Saved jobs in submission order.

        A job that was RUNNING comes back QUEUED (it is run again, a train job from its last
        checkpoint), unless the previous process crashed (no ``mark_clean_stop``) while it
        ran and it had already been running at the crash before: then it comes back FAILED
        ("crashed the coordinator twice"), so a job that kills the coordinator is not re-run
        forever.
        """
        out = []
        owners = dict(self._db.execute("SELECT job_id, owner FROM job_owners").fetchall())
        crashes = dict(self._db.execute("SELECT job_id, crashes FROM job_crashes").fetchall())
        pacing = {
            r[0]: (int(r[1]), bool(r[2]))
            for r in self._db.execute("SELECT job_id, granted, finish FROM job_pacing")
        }
        for row in self._db.execute("SELECT * FROM jobs ORDER BY seq"):
            (
                job_id,
                seq,
                spec_json,
                state,
                result_json,
                error,
                created,
                started,
                finished,
                workers_json,
            ) = row
            job = JobRecord(
                job_id=job_id,
                spec=job_spec_from_json(spec_json),
                seq=seq,
                state=JobState(state),
                error=error,
                created_at=created,
                started_at=started,
                finished_at=finished,
                workers=json.loads(workers_json),
                result=json.loads(result_json) if result_json else None,
                owner=owners.get(job_id, ""),
            )
            job.epochs_granted, job.finish_requested = pacing.get(job_id, (0, False))
            if job.state is JobState.RUNNING:
                self._resume(job, crashes.get(job_id, 0))
            out.append(job)
        return out

    def save_pacing(self, job_id: str, granted: int, finish: bool) -> None:
        """Save a paced job's epochs granted and whether its finish was asked for."""
        self._db.execute(
            "INSERT OR REPLACE INTO job_pacing VALUES (?, ?, ?)", (job_id, granted, int(finish))
        )

    def save_memory_progress(self, job_id: str, loaded: bool, iterations: int) -> None:
        """Save how far a memory job got: its load done, and iterations completed."""
        self._db.execute(
            "INSERT OR REPLACE INTO memory_progress VALUES (?, ?, ?)",
            (job_id, int(loaded), iterations),
        )

    def load_memory_progress(self, job_id: str) -> tuple[bool, int]:
        """Return (load done, iterations completed) of a memory job; (False, 0) if none saved."""
        row = self._db.execute(
            "SELECT loaded, iterations FROM memory_progress WHERE job_id = ?", (job_id,)
        ).fetchone()
        return (False, 0) if row is None else (bool(row[0]), int(row[1]))

    def _resume(self, job: JobRecord, crashes: int) -> None:
        """Queue a job found RUNNING again, or fail it at its second crash in a row."""
        if self.previous_crashed:
            crashes += 1
            self._db.execute(
                "INSERT OR REPLACE INTO job_crashes VALUES (?, ?)", (job.job_id, crashes)
            )
        if crashes >= CRASHES_BEFORE_FAILING:
            job.state, job.error, job.finished_at = JobState.FAILED, CRASHED_TWICE, _now()
            self.save_job(job)
            self.crashed_twice.append(job.job_id)
        else:
            job.state = JobState.QUEUED
            job.created_at = _now()  # a fresh queue timeout for the re-run

    # -- helpers --------------------------------------------------------------------------

    def _put(self, key: str, value: Any) -> None:
        self._db.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (key, json.dumps(value)))

    def _get(self, key: str) -> Any:
        row = self._db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])


def _now() -> float:
    import time

    return time.time()
