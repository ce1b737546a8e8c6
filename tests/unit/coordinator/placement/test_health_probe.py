"""The coordinator's one health probe (coordinator/placement/health_probe.py) and its callers.

The failure detector's probe after a report, the readmission check of a DEAD worker and the
RTT probe each wrote the same Check call (review: "the worker health probe is written three
times"); now they call ``probe_health``. The callers' verdicts are checked against each
other on the same fake worker, so a caller that grows its own idea of "answered" (say, only
SERVING) fails here.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2

from coordinator.network.link_probe import LinkProbe
from coordinator.network.link_stats import LinkStats
from coordinator.placement.failure_detector import FailureDetector
from coordinator.placement.health_probe import probe_health
from coordinator.placement.membership import Membership, WorkerState
from coordinator.placement.readmission import Readmission, ReadmissionRefused
from shared.metrics import Metrics
from tests.unit.coordinator.placement.test_membership import FakeClock

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection reset by peer"


class _Clients:
    """WorkerClients whose channels answer Check with ``status``, or fail when it is None."""

    def __init__(self, status: int | None) -> None:
        self.status = status
        self.checks: list[tuple[str, str, float]] = []  # (name, address, timeout_s)

    def channel(self, name: str, address: str) -> _Channel:
        return _Channel(self, name, address)


class _Channel:
    def __init__(self, clients: _Clients, name: str, address: str) -> None:
        self.clients, self.name, self.address = clients, name, address

    def unary_unary(self, *args: object, **kwargs: object) -> _Call:
        return _Call(self)

    unary_stream = unary_unary  # HealthStub makes Watch too; not called


class _Call:
    def __init__(self, channel: _Channel) -> None:
        self.channel = channel

    async def __call__(self, request: object, **kwargs: float) -> object:
        c = self.channel
        c.clients.checks.append((c.name, c.address, kwargs["timeout"]))
        if c.clients.status is None:
            raise _Unavailable()
        return health_pb2.HealthCheckResponse(status=c.clients.status)


class _Rebalancer:
    def trigger(self) -> None:
        pass


async def test_an_answer_whatever_its_status_is_reachable_and_a_failure_says_why() -> None:
    for status in (SERVING, NOT_SERVING):
        clients = _Clients(status)
        assert await probe_health(clients, "w0", "h:1", 2.5) is None  # type: ignore[arg-type]
        assert clients.checks == [("w0", "h:1", 2.5)]

    down = _Clients(None)
    reason = await probe_health(down, "w0", "h:9", 0.5)  # type: ignore[arg-type]

    assert reason == "UNAVAILABLE: connection reset by peer"
    assert down.checks == [("w0", "h:9", 0.5)]


async def _detector_verdict(clients: _Clients) -> bool:
    """Whether the failure detector's probe after a report found ``w0`` reachable."""
    m = Membership(60.0)
    m.register("w0", "h:1", "cpu", "p0")
    detector = FailureDetector(
        m,
        _Rebalancer(),  # type: ignore[arg-type]
        clients,  # type: ignore[arg-type]
        Metrics(),
        heartbeat_interval_s=1.0,
        heartbeat_timeout_s=60.0,
        probe_timeout_s=0.7,
        on_dead=lambda: None,
    )
    await detector._probe("w0")
    return m.get("w0").state is WorkerState.ALIVE


async def _readmission_verdict(clients: _Clients) -> bool:
    """Whether the readmission check of DEAD ``w0``, past its hold-down, found it reachable."""
    clock = FakeClock()
    m = Membership(60.0, clock=clock, holddown_base_s=1.0, holddown_max_s=8.0)
    m.register("w0", "h:1", "cpu", "p0")
    m.mark_dead("w0")
    clock.now += 1.0
    gate = Readmission(m, clients, Metrics(), check_timeout_s=0.7)  # type: ignore[arg-type]
    try:
        await gate.check("w0", "h:1")
    except ReadmissionRefused as refused:
        assert "UNAVAILABLE: connection reset by peer" in str(refused)
        return False
    return True


async def _link_probe_verdict(clients: _Clients) -> bool:
    """Whether the RTT probe of ``w0`` got a sample."""
    m = Membership(60.0)
    rec, _, _ = m.register("w0", "h:1", "cpu", "p0")
    probe = LinkProbe(LinkStats(), m.alive, clients, Metrics(), 1.0, 0.7)  # type: ignore[arg-type]
    return await probe.probe(rec) is not None


@pytest.mark.parametrize("status", [SERVING, NOT_SERVING, None], ids=["serving", "not", "down"])
async def test_every_caller_judges_a_worker_as_the_probe_does(status: int | None) -> None:
    # Arrange
    expected = await probe_health(_Clients(status), "w0", "h:1", 0.7) is None  # type: ignore[arg-type]
    callers = {
        "failure detector": _detector_verdict,
        "readmission": _readmission_verdict,
        "link probe": _link_probe_verdict,
    }

    # Act
    verdicts = {}
    for name, verdict in callers.items():
        clients = _Clients(status)
        verdicts[name] = await verdict(clients)
        assert clients.checks == [("w0", "h:1", 0.7)], name  # one check, the caller's timeout

    # Assert
    assert verdicts == dict.fromkeys(callers, expected)
