"""The hold-down of a worker declared DEAD (coordinator/placement/membership.py) and the readmission
check (coordinator/placement/readmission.py), without a cluster: an injected clock, a fake health
probe.

Issue 20, item 3: a worker whose heartbeats reach the coordinator while nobody reaches it
rejoined and died again every ~0.5 s; now it waits out a hold-down that doubles while it keeps
failing, and is admitted only once the coordinator's health check of it answers.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2

from coordinator.placement.membership import Membership, WorkerState
from coordinator.placement.readmission import PUSHBACK_KEY, Readmission, ReadmissionRefused
from shared.metrics import Metrics
from tests.unit.coordinator.placement.test_membership import FakeClock

BASE_S, MAX_S = 1.0, 8.0  # 2 x heartbeat_interval_s, readmit_holddown_max_s


def refusals(metrics: Metrics) -> float | None:
    """``neuroshard_readmissions_refused_total`` as scraped."""
    return metrics.registry.get_sample_value("neuroshard_readmissions_refused_total")


def _membership(clock: FakeClock) -> Membership:
    m = Membership(60.0, clock=clock, holddown_base_s=BASE_S, holddown_max_s=MAX_S)
    m.register("w0", "h:1", "cpu", "p0")
    return m


def test_a_first_death_holds_the_worker_down_for_the_base() -> None:
    clock = FakeClock()
    m = _membership(clock)

    m.mark_dead("w0")

    assert m.readmit_wait_s("w0") == BASE_S
    clock.now += 0.25
    assert m.readmit_wait_s("w0") == BASE_S - 0.25
    clock.now += BASE_S
    assert m.readmit_wait_s("w0") == 0.0


def test_dying_again_soon_after_admission_doubles_up_to_the_cap() -> None:
    clock = FakeClock()
    m = _membership(clock)
    holds = []

    for _ in range(6):  # die, wait out the hold-down, rejoin, die again at once
        m.mark_dead("w0")
        holds.append(m.readmit_wait_s("w0"))
        clock.now += holds[-1]
        m.register("w0", "h:1", "cpu", "p0")

    assert holds == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


def test_staying_alive_for_the_cap_resets_the_hold_down() -> None:
    clock = FakeClock()
    m = _membership(clock)
    for _ in range(3):
        m.mark_dead("w0")
        clock.now += m.readmit_wait_s("w0")
        m.register("w0", "h:1", "cpu", "p0")

    clock.now += MAX_S  # healthy for as long as the cap
    m.mark_dead("w0")

    assert m.readmit_wait_s("w0") == BASE_S


def test_a_failed_check_doubles_the_hold_down_and_an_alive_worker_has_none() -> None:
    clock = FakeClock()
    m = _membership(clock)
    assert m.readmit_refused("w0") == 0.0  # ALIVE: nothing to hold down
    assert m.readmit_wait_s("w0") == 0.0 and m.readmit_wait_s("nobody") == 0.0
    m.mark_dead("w0")

    refused = [m.readmit_refused("w0") for _ in range(5)]

    assert refused == [2.0, 4.0, 8.0, 8.0, 8.0]
    assert m.readmit_wait_s("w0") == MAX_S


def test_a_silent_worker_swept_dead_is_held_down_too() -> None:
    clock = FakeClock()
    m = _membership(clock)
    clock.now += 61.0

    assert [r.name for r in m.sweep()] == ["w0"]
    assert m.readmit_wait_s("w0") == BASE_S


def test_a_cap_of_zero_holds_nobody_down() -> None:
    m = Membership(60.0, clock=FakeClock(), holddown_base_s=BASE_S, holddown_max_s=0.0)
    m.register("w0", "h:1", "cpu", "p0")
    m.mark_dead("w0")

    assert m.readmit_wait_s("w0") == 0.0
    assert m.readmit_refused("w0") == 0.0


# -- the check ---------------------------------------------------------------------------------


class _Clients:
    """WorkerClients whose channels answer a health check as told (or fail with UNAVAILABLE)."""

    def __init__(self, reachable: bool) -> None:
        self.reachable = reachable
        self.checked: list[tuple[str, str]] = []

    def channel(self, name: str, address: str) -> _Channel:
        self.checked.append((name, address))
        return _Channel(self.reachable)


class _Channel:
    def __init__(self, reachable: bool) -> None:
        self.reachable = reachable

    def unary_unary(self, *args: object, **kwargs: object) -> _Call:
        return _Call(self.reachable)

    unary_stream = unary_unary  # HealthStub makes Watch too; not called


class _Call:
    def __init__(self, reachable: bool) -> None:
        self.reachable = reachable

    async def __call__(self, request: object, **kwargs: object) -> object:
        if not self.reachable:
            raise _Unavailable()
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection reset by peer"


async def test_a_dead_worker_is_refused_during_its_hold_down_without_a_probe() -> None:
    clock = FakeClock()
    m = _membership(clock)
    m.mark_dead("w0")
    clients = _Clients(reachable=True)
    metrics = Metrics()
    gate = Readmission(m, clients, metrics, check_timeout_s=1.0)  # type: ignore[arg-type]

    with pytest.raises(ReadmissionRefused) as refused:
        await gate.check("w0", "h:1")

    assert "held down for 1.00 s more" in str(refused.value)
    assert "retry in 1.00 s" in str(refused.value)
    assert refused.value.pushback() == ((PUSHBACK_KEY, "1000"),)
    assert clients.checked == []  # no probe while held down
    assert refusals(metrics) == 1  # counted as scraped
    assert m.readmit_wait_s("w0") == BASE_S  # a refusal in the hold-down does not extend it
    assert m.get("w0").state is WorkerState.DEAD


async def test_an_unreachable_dead_worker_is_refused_and_held_down_longer() -> None:
    clock = FakeClock()
    m = _membership(clock)
    m.mark_dead("w0")
    clock.now += BASE_S
    clients = _Clients(reachable=False)
    metrics = Metrics()
    gate = Readmission(m, clients, metrics, check_timeout_s=1.0)  # type: ignore[arg-type]

    with pytest.raises(ReadmissionRefused) as refused:
        await gate.check("w0", "h:9")

    message = str(refused.value)
    assert "cannot reach it at h:9" in message and "connection reset by peer" in message
    assert "retry in 2.00 s" in message and refused.value.retry_after_s == 2 * BASE_S
    assert clients.checked == [("w0", "h:9")]  # the address it registers with
    assert m.readmit_wait_s("w0") == 2 * BASE_S and refusals(metrics) == 1


async def test_a_reachable_dead_worker_after_its_hold_down_and_any_live_one_pass() -> None:
    clock = FakeClock()
    m = _membership(clock)
    m.register("w1", "h:2", "cpu", "p1")
    m.mark_dead("w0")
    clock.now += BASE_S
    clients = _Clients(reachable=True)
    metrics = Metrics()
    gate = Readmission(m, clients, metrics, check_timeout_s=1.0)  # type: ignore[arg-type]

    await gate.check("w0", "h:1")
    await gate.check("w1", "h:2")  # ALIVE: no check
    await gate.check("new", "h:3")  # unknown: no check

    assert clients.checked == [("w0", "h:1")] and refusals(metrics) == 0
