"""coordinator/placement/membership.py without a cluster: registration, heartbeats, the timeout that
declares a worker dead (an injected clock, no sleeps), drain and restart detection."""

from __future__ import annotations

from coordinator.placement.membership import Membership, WorkerState

TIMEOUT_S = 10.0


class FakeClock:
    """A monotonic clock the test moves by hand (seconds)."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _membership(clock: FakeClock) -> Membership:
    return Membership(TIMEOUT_S, clock=clock)


def test_registering_a_new_worker_makes_it_alive_as_of_now() -> None:
    clock = FakeClock(100.0)
    m = _membership(clock)

    rec, changed, restarted = m.register("w0", "h:1", "cpu", "p1")

    assert (changed, restarted) == (True, False)
    assert (rec.state, rec.address, rec.device, rec.process_id) == (
        WorkerState.ALIVE,
        "h:1",
        "cpu",
        "p1",
    )
    assert (rec.last_heartbeat, rec.registered_at, rec.incarnation) == (100.0, 100.0, 0)
    assert m.get("w0") is rec and m.get("w1") is None


def test_re_registering_the_same_process_at_the_same_address_changes_nothing() -> None:
    clock = FakeClock()
    m = _membership(clock)
    m.register("w0", "h:1", "cpu", "p1")
    clock.now += 3.0

    rec, changed, restarted = m.register("w0", "h:1", "cpu", "p1")

    assert (changed, restarted) == (False, False)
    assert (rec.incarnation, rec.last_heartbeat) == (1, clock.now)


def test_a_new_address_is_a_change_but_not_a_restart() -> None:
    m = _membership(FakeClock())
    m.register("w0", "h:1", "cpu", "p1")

    rec, changed, restarted = m.register("w0", "h:2", "cpu", "p1")

    assert (changed, restarted, rec.address) == (True, False, "h:2")


def test_a_new_process_id_under_a_known_name_is_a_restart() -> None:
    m = _membership(FakeClock())
    m.register("w0", "h:1", "cpu", "p1")

    rec, changed, restarted = m.register("w0", "h:1", "cpu", "p2")

    assert (changed, restarted, rec.process_id) == (True, True, "p2")


def test_registration_forgets_the_map_epoch_and_the_restored_mark() -> None:
    m = _membership(FakeClock())
    rec, _, _ = m.register("w0", "h:1", "cpu", "p1")
    rec.slot_map_epoch, rec.restored = 7, True  # as the coordinator's restore leaves it

    m.register("w0", "h:1", "cpu", "p1")

    assert (rec.slot_map_epoch, rec.restored) == (0, False)


def test_a_heartbeat_records_time_memories_and_epoch_and_confirms_a_restored_worker() -> None:
    clock = FakeClock()
    m = _membership(clock)
    rec, _, _ = m.register("w0", "h:1", "cpu")
    rec.restored = True
    clock.now += 4.0

    got = m.heartbeat("w0", memories=42, epoch=5)

    assert got is rec
    assert (rec.last_heartbeat, rec.memories, rec.slot_map_epoch) == (clock.now, 42, 5)
    assert rec.restored is False
    assert m.heartbeat_age_s(rec) == 0.0
    clock.now += 2.5
    assert m.heartbeat_age_s(rec) == 2.5


def test_a_heartbeat_from_an_unknown_worker_asks_it_to_register() -> None:
    m = _membership(FakeClock())

    assert m.heartbeat("ghost", memories=1) is None
    assert m.all() == []


def test_a_silent_worker_is_declared_dead_only_after_the_timeout() -> None:
    clock = FakeClock()
    m = _membership(clock)
    m.register("w0", "h:1", "cpu")
    m.register("w1", "h:2", "cpu")

    clock.now += TIMEOUT_S  # exactly the timeout: not yet
    assert m.sweep() == []
    m.heartbeat("w1", memories=0)
    clock.now += 0.5  # w0 is now past its timeout, w1 heard from 0.5 s ago
    dead = m.sweep()

    assert [w.name for w in dead] == ["w0"]
    assert m.get("w0").state is WorkerState.DEAD  # type: ignore[union-attr]
    assert [w.name for w in m.alive()] == ["w1"]
    assert m.sweep() == []  # reported once
    assert m.counts() == {"ALIVE": 1, "DEAD": 1, "DRAINING": 0}


def test_a_dead_worker_must_register_again_and_then_counts_as_a_change() -> None:
    clock = FakeClock()
    m = _membership(clock)
    m.register("w0", "h:1", "cpu", "p1")
    clock.now += TIMEOUT_S + 1
    m.sweep()

    assert m.heartbeat("w0", memories=3) is None  # a late heartbeat does not revive it
    rec, changed, restarted = m.register("w0", "h:1", "cpu", "p1")

    assert (rec.state, changed, restarted) == (WorkerState.ALIVE, True, False)


def test_mark_dead_reports_whether_the_worker_was_alive() -> None:
    m = _membership(FakeClock())
    m.register("w0", "h:1", "cpu")

    assert m.mark_dead("w0") is True
    assert m.mark_dead("w0") is False
    assert m.mark_dead("ghost") is False
    assert m.alive() == []


def test_a_draining_worker_leaves_the_alive_list_but_still_times_out() -> None:
    clock = FakeClock()
    m = _membership(clock)
    for name in ("w1", "w0"):
        m.register(name, f"h:{name}", "cpu")

    assert m.set_draining("w1") is True
    assert m.set_draining("w1") is False  # already draining
    assert m.set_draining("ghost") is False
    assert [w.name for w in m.alive()] == ["w0"]
    assert [w.name for w in m.draining()] == ["w1"]
    assert [w.name for w in m.all()] == ["w0", "w1"]  # ordered by name
    m.heartbeat("w0", memories=0)  # heartbeats keep a draining worker's state
    assert m.heartbeat("w1", memories=0) is not None
    assert m.get("w1").state is WorkerState.DRAINING  # type: ignore[union-attr]

    clock.now += TIMEOUT_S + 1
    assert {w.name for w in m.sweep()} == {"w0", "w1"}
    assert m.set_draining("w0") is False  # a dead worker cannot start draining


def test_the_training_device_is_kept_apart_from_the_kernels_device(tmp_path) -> None:
    from coordinator.persistence import StateStore

    m = _membership(FakeClock())
    rec, _, _ = m.register("w0", "h:1", "cpu", "p1", train_device="cuda:0")
    assert (rec.device, rec.train_device) == ("cpu", "cuda:0")
    assert m.register("w1", "h:2", "cpu")[0].train_device == "cpu"  # the default

    store = StateStore(tmp_path)
    store.save_worker("w0", "h:1", "cpu", "p1", "cuda:0")
    # As an earlier version saved it: no training device recorded.
    store._db.execute("INSERT INTO workers VALUES ('w1', 'h:2', 'cpu', 'p2')")
    store.close()
    saved = {w.name: w.train_device for w in StateStore(tmp_path).load_workers()}

    assert saved == {"w0": "cuda:0", "w1": "cpu"}


def test_excuse_silence_gives_every_live_worker_a_fresh_timeout() -> None:
    # Arrange: w0 silent for longer than the timeout, w1 dead already.
    clock = FakeClock(100.0)
    m = _membership(clock)
    m.register("w0", "h:1", "cpu", "p0")
    m.register("w1", "h:2", "cpu", "p1")
    m.mark_dead("w1")
    clock.now += TIMEOUT_S + 1

    # Act: the coordinator noticed it had been paused.
    m.excuse_silence()

    # Assert: no sweep declares w0 dead until a whole timeout passes again; w1 stays dead.
    assert m.sweep() == []
    assert m.get("w1").state is WorkerState.DEAD
    clock.now += TIMEOUT_S + 0.1
    assert [r.name for r in m.sweep()] == ["w0"]
