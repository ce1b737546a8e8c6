"""A worker's durable slot data: a snapshot file plus a log of the mutations since.

Both live in ``data_dir`` (formats in ``worker/store/journal_format.py``):

    LOCK              flock'ed by the worker process using the directory
    snapshot.bin      the whole store as of log generation g (``write_private``: tmp, fsync,
                      rename, fsync dir)
    log-<g>.wal       records applied after snapshot g, then log-<g+1>.wal, ... in apply order

Records are appended on the store thread inside the job that applies the mutation, so log
order is apply order. Durability follows ``fsync``: ``always`` (``await sync(pos)`` waits for
the fsync before the write is acknowledged; group commit: one fsync covers every record
appended before it started, ``worker/store/group_commit.py``), ``interval`` (a
thread fsyncs every ``fsync_interval_s``) or ``never`` (the OS writes back when it likes; a
killed process loses nothing, a power cut may). When the log outgrows
``snapshot_log_bytes`` the store thread copies the arrays (memcpy) and starts a new segment;
another thread writes the snapshot and deletes the segments it replaces, so writes never
wait for a snapshot file.

A failed write or fsync of the log is final (``StorageFailed``): after a failed fsync the
kernel may have dropped the dirty pages and a second fsync can succeed without them
(PostgreSQL's "fsyncgate", 2018), so the journal never retries; it refuses every later append
and sync, and calls ``on_failure`` once so the worker reports itself unhealthy.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.fsync import fsync_dir
from shared.logging import get_logger
from shared.memory.tables import DEFAULT_TABLE
from shared.memory.validation import MemoryInputError
from shared.private_files import open_private, private_dir, write_private
from shared.proto import common_pb2, worker_pb2
from worker.store import journal_format as fmt
from worker.store.dedup import RecentRequests
from worker.store.group_commit import GroupCommit
from worker.store.journal_format import JournalError, Request, SnapshotState
from worker.store.store import SlotSnapshot, SlotStore

log = get_logger(__name__)
SNAPSHOT = "snapshot.bin"


class StorageFailed(Exception):
    """The journal failed to write or fsync; this worker acknowledges no write (UNAVAILABLE)."""


def segment_path(data_dir: Path, gen: int) -> Path:
    """Return the path of log segment ``gen`` in ``data_dir``."""
    return data_dir / f"log-{gen:012d}.wal"


def lock_data_dir(data_dir: Path) -> int:
    """Create ``data_dir`` and take its exclusive lock; return the lock's fd.

    Raises:
        JournalError: another worker (process or in-process server) uses the directory.
    """
    private_dir(data_dir)  # 0700: the journal holds payloads
    fd = open_private(data_dir / "LOCK", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise JournalError(f"data_dir {data_dir} is in use by another worker") from None
    return fd


@dataclass
class Recovered:
    """What ``recover`` rebuilt from a data dir.

    Attributes:
        store: the slot data.
        requests: the request ids to re-record, oldest first.
        next_gen: the log generation to start.
        log_bytes: log bytes replayed (they count toward the next snapshot).
        records: log records replayed.
        seconds: time the recovery took.
    """

    store: SlotStore
    requests: list[Request]
    next_gen: int
    log_bytes: int
    records: int
    seconds: float


def recover(data_dir: Path, make_store: Callable[[int], SlotStore]) -> Recovered | None:
    """Rebuild a store from ``data_dir``: the snapshot, then every later log segment.

    A torn or corrupt record ends the replay: its segment is truncated there and later
    segments are deleted (what follows a gap cannot be applied). Caller holds the lock.

    Args:
        data_dir: the worker's data directory.
        make_store: builds an empty store with the given slot count.

    Returns:
        None when the directory holds no data.

    Raises:
        JournalError: corrupt snapshot, or files of different slot counts.
    """
    t0 = time.perf_counter()
    snap_file = data_dir / SNAPSHOT
    state = None
    if snap_file.exists():
        state = fmt.decode_snapshot(snap_file.read_bytes(), str(snap_file))
    gens = sorted(int(p.stem[4:]) for p in data_dir.glob("log-*.wal"))
    first = state.gen if state is not None else (gens[0] if gens else 0)
    for g in [g for g in gens if g < first]:  # superseded by the snapshot, not yet deleted
        segment_path(data_dir, g).unlink()
    gens = [g for g in gens if g >= first]
    slots = state.slots if state is not None else _segment_slots(data_dir, gens)
    if slots is None:
        return None
    fmt.check_slot_count(slots, str(segment_path(data_dir, gens[0]) if gens else data_dir))
    store = make_store(slots)
    recent = RecentRequests()  # replayed as they were recorded, imports replacing a slot's
    for rid, applied in state.recent if state is not None else []:
        recent.record(rid, np.asarray(applied, np.int64))
    if state is not None:
        restore(store, state)
    records = log_bytes = 0
    for i, g in enumerate(gens):
        path = segment_path(data_dir, g)
        buf = path.read_bytes()
        _check_header(buf, path, slots)
        good = fmt.LOG_HEADER.size if len(buf) >= fmt.LOG_HEADER.size else 0
        for end, kind, body in fmt.read_frames(buf, fmt.LOG_HEADER.size):
            fmt.replay(
                store,
                kind,
                body,
                lambda rid, s: recent.record(rid, np.asarray(s, np.int64)),
                recent.replace_slot,
            )
            records, good = records + 1, end
        log_bytes += good
        if good < len(buf):
            log.warning(
                "journal_torn_tail",
                path=str(path),
                kept_bytes=good,
                dropped_bytes=len(buf) - good,
                later_segments_dropped=len(gens) - i - 1,
            )
            _truncate(path, good)
            for later in gens[i + 1 :]:
                segment_path(data_dir, later).unlink()
            break
    next_gen = max(gens, default=first - 1) + 1
    return Recovered(
        store, recent.entries(), next_gen, log_bytes, records, time.perf_counter() - t0
    )


def restore(store: SlotStore, state: SnapshotState) -> None:
    """Replace an empty store's content with a snapshot's.

    Raises:
        JournalError: the snapshot's ids repeat or its seqs are not one per slot.
    """
    try:
        store.load(state.ids, state.strengths, state.payloads, state.seq)
        for t in state.tables:
            store.load(t.ids, t.strengths, t.payloads, state.seq, t.name, t.id, t.stamps)
    except MemoryInputError as exc:
        raise JournalError(f"snapshot: {exc}") from exc


def _segment_slots(data_dir: Path, gens: list[int]) -> int | None:
    for g in gens:
        with open(segment_path(data_dir, g), "rb") as f:
            head = f.read(fmt.LOG_HEADER.size)
        if len(head) == fmt.LOG_HEADER.size and head[:8] == fmt.LOG_MAGIC:
            return int(fmt.LOG_HEADER.unpack(head)[1])
    return None


def _check_header(buf: bytes, path: Path, slots: int) -> None:
    if len(buf) < fmt.LOG_HEADER.size:
        return  # torn while being created: an empty segment
    magic, seg_slots, _ = fmt.LOG_HEADER.unpack_from(buf)
    if magic != fmt.LOG_MAGIC:
        raise JournalError(f"{path}: not a neuroshard log segment (bad magic)")
    if seg_slots != slots:
        raise JournalError(f"{path}: {seg_slots} slots, but the snapshot has {slots}")


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)
        f.flush()
        os.fsync(f.fileno())


def capture(store: SlotStore, recent: list[Request], gen: int) -> SnapshotState:
    """Copy a store's arrays for a snapshot (call on the store thread)."""
    ids, strengths = store.rows()
    tables = []
    for name, table_id in sorted(store.tables().items()):
        if name != DEFAULT_TABLE:
            t_ids, t_strengths = store.rows(name)
            t = store.table(name)
            state = fmt.TableState(
                name, table_id, t_ids, t_strengths, dict(t.payloads), dict(t.stamps)
            )
            tables.append(state)
    return SnapshotState(
        store.slots, gen, store.seq.copy(), ids, strengths, dict(store.payloads), recent, tables
    )


class Journal:
    """Appends records, syncs them per policy, and takes snapshots in the background."""

    def __init__(
        self,
        data_dir: Path,
        lock_fd: int,
        slots: int,
        gen: int,
        fsync: str,
        fsync_interval_s: float,
        snapshot_log_bytes: int,
        log_bytes: int = 0,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        """Start log segment ``gen`` (and the interval fsync thread, if that is the policy).

        Args:
            data_dir: the worker's directory.
            lock_fd: the directory's lock (released by close).
            slots: S.
            gen: the generation of the segment to start.
            fsync: "always", "interval" or "never".
            fsync_interval_s: seconds between fsyncs, for "interval".
            snapshot_log_bytes: log bytes after which a snapshot is taken.
            log_bytes: bytes already in the log since the last snapshot.
            on_failure: called once, with the reason, when a write or fsync of the log fails
                (from the thread that saw it).
        """
        self.dir, self._lock_fd, self.slots, self.policy = data_dir, lock_fd, slots, fsync
        self._snapshot_log_bytes = snapshot_log_bytes
        self.gen = gen
        self.written = self.synced = 0  # bytes appended / known durable, all segments together
        self.since_snapshot = log_bytes
        self.failure = ""  # why the log failed; set once, never cleared
        self._on_failure = on_failure
        self._fail_lock = threading.Lock()
        self._fd_lock = threading.Lock()
        self._fd = self._open_segment(gen)
        # fsync "always": one fsync thread shared by every write waiting (group commit).
        self._commits = GroupCommit(self._fsync_now) if fsync == "always" else None
        self._snap_pool = ThreadPoolExecutor(1, thread_name_prefix="journal-snapshot")
        self._snapshotting = False
        self.snapshots = 0
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if fsync == "interval":
            self._ticker = threading.Thread(
                target=self._tick, args=(fsync_interval_s,), name="journal-interval", daemon=True
            )
            self._ticker.start()

    def _open_segment(self, gen: int) -> int:
        fd = open_private(segment_path(self.dir, gen))
        os.write(fd, fmt.LOG_HEADER.pack(fmt.LOG_MAGIC, self.slots, gen))
        if self.policy != "never":
            os.fsync(fd)
            fsync_dir(self.dir)
        return fd

    # -- appends (store thread) -------------------------------------------------------------

    def check(self) -> None:
        """Raises: StorageFailed once a write or fsync of the log failed (UNAVAILABLE)."""
        if self.failure:
            raise self._refusal()

    def _refusal(self) -> StorageFailed:
        return StorageFailed(
            f"the journal in {self.dir} failed ({self.failure}); this worker acknowledges "
            "no more writes until it is restarted"
        )

    def _fail(self, what: str, exc: OSError) -> StorageFailed:
        """Mark the log failed for good (first failure only: log it, tell ``on_failure``)."""
        with self._fail_lock:
            first = not self.failure
            if first:
                self.failure = f"{what}: {exc}"
        if first:
            log.error("journal_failed", data_dir=str(self.dir), op=what, error=str(exc))
            if self._on_failure is not None:
                self._on_failure(self.failure)
        return self._refusal()

    def append(self, kind: bytes, body: bytes) -> int:
        """Write one record; return the log position to ``sync`` to for it.

        Raises:
            StorageFailed: the log failed, now or before (UNAVAILABLE).
        """
        self.check()
        data = fmt.frame(kind, body)
        view = memoryview(data)
        try:
            while len(view):
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            raise self._fail("write", exc) from exc
        n = len(data)
        self.written += n
        self.since_snapshot += n
        return self.written

    def log_op(self, req: worker_pb2.ReplicateRequest) -> int:
        """Append a replicated op record; return the journal position to wait for."""
        return self.append(fmt.KIND_OP, req.SerializeToString())

    def log_import(self, snap: SlotSnapshot) -> int:
        """Append an import record of one table's part of a slot; return its position."""
        return self.append(fmt.KIND_IMPORT, fmt.encode_import(snap))

    def log_table(self, name: str, table_id: int) -> int:
        """Append a record of a table's incarnation id adopted; return its journal position."""
        body = common_pb2.TableSpec(name=name, id=table_id).SerializeToString()
        return self.append(fmt.KIND_TABLE, body)

    def log_drop_table(self, name: str) -> int:
        """Append a record of a table dropped; return its journal position."""
        return self.append(fmt.KIND_DROP_TABLE, name.encode())

    def log_drop(self, slots: np.ndarray) -> int:
        """Append a record of dropped slots; return its journal position."""
        return self.append(fmt.KIND_DROP, np.asarray(slots, "<u4").tobytes())

    # -- durability -------------------------------------------------------------------------

    def kick(self, pos: int) -> None:
        """Start making the log up to ``pos`` durable now, without waiting (store thread).

        ``always``: the fsync thread starts (or its next fsync covers ``pos``) while the
        event loop forwards the write; ``sync`` then only waits. Otherwise nothing.
        """
        if self._commits is not None:
            self._commits.request(pos)

    async def sync(self, pos: int) -> None:
        """Return once the log up to ``pos`` (bytes) is durable as the policy demands.

        ``always``: once fsynced, by the fsync that covers every record appended before it
        started (``worker/store/group_commit.py``); otherwise at once.

        Raises:
            StorageFailed: the log failed, now or before, under any policy (UNAVAILABLE).
        """
        self.check()
        if self._commits is not None and self.synced < pos:
            await self._commits.wait(pos)

    def _fsync_now(self) -> int:
        """Make the log durable (os.fsync); return the position it covered.

        Raises:
            StorageFailed: the fsync failed, now or before (UNAVAILABLE).
        """
        self.check()  # never fsync again after a failed one: it could "succeed" without data
        with self._fd_lock:
            end = self.written
            try:
                os.fsync(self._fd)
            except OSError as exc:
                failed = exc
            else:
                self.synced = max(self.synced, end)
                return end
        raise self._fail("fsync", failed) from failed

    def _sync_to(self, pos: int) -> None:
        if self.synced < pos:
            self._fsync_now()

    def _tick(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            if self.synced < self.written:
                try:
                    self._sync_to(self.written)
                except StorageFailed:
                    return  # logged and reported by _fail; later writes are refused

    # -- snapshots --------------------------------------------------------------------------

    def snapshot_due(self) -> bool:
        """True when the log has outgrown the limit and no snapshot is being written."""
        return self.since_snapshot >= self._snapshot_log_bytes and not self._snapshotting

    def maybe_snapshot(self, store: SlotStore, recent: Callable[[], list[Request]]) -> None:
        """On the store thread: snapshot when the log has outgrown the limit.

        Unless a snapshot is being written already: copy the store, start a new segment, and
        write the snapshot on another thread.
        """
        if self.snapshot_due():
            self.snapshot(store, recent)

    def snapshot(self, store: SlotStore, recent: Callable[[], list[Request]]) -> None:
        """Start a snapshot now (store thread); it is written by a background thread."""
        self.check()
        state = capture(store, recent(), self.gen + 1)
        try:
            new_fd = self._open_segment(self.gen + 1)
            with self._fd_lock:
                if self.policy != "never":
                    os.fsync(self._fd)  # the old segment, before it stops being appended to
                    self.synced = self.written
                    if self._commits is not None:
                        self._commits.mark(self.synced)
                os.close(self._fd)
                self._fd, self.gen, self.since_snapshot = new_fd, self.gen + 1, 0
        except OSError as exc:
            raise self._fail("log rotation", exc) from exc
        self._snapshotting = True
        self._snap_pool.submit(self._write_snapshot, state)

    def _write_snapshot(self, state: SnapshotState) -> None:
        t0 = time.perf_counter()
        try:
            write_private(self.dir / SNAPSHOT, fmt.encode_snapshot(state))
            for p in self.dir.glob("log-*.wal"):
                if int(p.stem[4:]) < state.gen:
                    p.unlink()
            self.snapshots += 1
            log.info(
                "journal_snapshot",
                memories=len(state.ids),
                gen=state.gen,
                seconds=round(time.perf_counter() - t0, 3),
            )
        except OSError as exc:  # the older snapshot and segments stay valid
            log.error("journal_snapshot_failed", error=str(exc))
        finally:
            self._snapshotting = False

    # -- shutdown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Finish a running snapshot, fsync (unless ``never``), release the directory."""
        self._shutdown(sync=self.policy != "never", crash=False)

    def abandon(self) -> None:
        """Drop the journal as ``kill -9`` would: close the files without fsync or flush.

        What a killed process leaves: the bytes already written (appends are unbuffered
        ``os.write`` calls, so they are in the OS's page cache) and nothing more; queued fsyncs
        are cancelled, the interval thread stops, and nothing is synced on the way out. A
        snapshot being written is waited for, since a thread cannot be killed (a real crash
        would leave ``.snapshot.bin.tmp`` behind, which recovery ignores). Tests use it to crash
        and restart a worker in one process.
        """
        self._shutdown(sync=False, crash=True)

    def _shutdown(self, sync: bool, crash: bool) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()  # its wait returns at once: no fsync of a closed fd after this
        self._snap_pool.shutdown(wait=True)
        if self._commits is not None:
            self._commits.close()  # after its running fsync; a crash leaves the rest undone
        with self._fd_lock:
            if self._fd >= 0:
                if sync and not self.failure:  # a failed log is never fsynced again
                    os.fsync(self._fd)
                os.close(self._fd)
                self._fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # closing the fd releases the flock
            self._lock_fd = -1
