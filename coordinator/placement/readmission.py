"""Readmission of a worker declared DEAD: only once reachable, and not during its hold-down.

A worker's own heartbeats reaching the coordinator say nothing of whether anybody reaches
it: with its inbound link cut (an asymmetric partition) it would register again at its next
heartbeat, fail the next copy to it, be declared DEAD by the probe that follows, and so on,
every heartbeat or two, each time a new map epoch and a round of slot copies begun and
abandoned. So a DEAD worker's registration is refused (UNAVAILABLE) while its hold-down runs
(``Membership``: doubling while it keeps failing, up to ``readmit_holddown_max_s``), and then
until a health check of the address it registers with answers; each failed check doubles the
hold-down. A worker that is not DEAD (new, ALIVE, DRAINING) registers as before.

The refusal carries ``grpc-retry-pushback-ms`` (gRPC's retry design, A6): the worker's
channel retries the registration itself when the hold-down ends, and its registration loop
retries after that.
"""

from __future__ import annotations

from coordinator.placement.health_probe import probe_health
from coordinator.placement.membership import Membership, WorkerState
from shared.logging import get_logger
from shared.metrics import Metrics
from shared.rpc.peers import WorkerClients

log = get_logger(__name__)

# Trailing metadata telling a gRPC client with a retry policy when to try again (A6,
# https://github.com/grpc/proposal/blob/master/A6-client-retries.md#pushback).
PUSHBACK_KEY = "grpc-retry-pushback-ms"


class ReadmissionRefused(Exception):
    """A DEAD worker may not register yet (UNAVAILABLE); ``retry_after_s`` says when to try.

    Attributes:
        retry_after_s: seconds until its hold-down ends.
    """

    def __init__(self, message: str, retry_after_s: float) -> None:
        """Say why, and in how many seconds a new registration may succeed."""
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def pushback(self) -> tuple[tuple[str, str], ...]:
        """The refusal's trailing metadata: when the caller's channel should retry."""
        return ((PUSHBACK_KEY, str(max(1, round(self.retry_after_s * 1000)))),)


class Readmission:
    """Decides whether a registering worker that is DEAD may be admitted again."""

    def __init__(
        self,
        membership: Membership,
        clients: WorkerClients,
        metrics: Metrics,
        check_timeout_s: float,
    ) -> None:
        """Check against ``membership``'s hold-downs; probe through ``clients``' channels.

        Args:
            membership: the registry holding each worker's state and hold-down.
            clients: the coordinator's channels to the workers.
            metrics: ``neuroshard_readmissions_refused_total`` counts each refusal.
            check_timeout_s: seconds the health check of a registering worker may take,
                connecting included.
        """
        self._membership = membership
        self._clients = clients
        self._refused = metrics.readmissions_refused
        self._timeout_s = check_timeout_s

    async def check(self, name: str, address: str) -> None:
        """Return when worker ``name`` may register at ``address``; raise when not yet.

        A worker that is not DEAD may always. A DEAD one may once its hold-down is over and
        a health check of ``address`` answers (whatever the status: the coordinator reaches
        it). The check goes through the coordinator's own channel to the worker, the one its
        failure probes and map pushes use: while that channel is still in gRPC's reconnect
        backoff from the partition it fails fast, and admitting the worker then would get it
        declared DEAD again at the first failed copy.

        Args:
            name: the registering worker.
            address: ``host:port`` it registers with (its advertised address).

        Raises:
            ReadmissionRefused: its hold-down runs, or the check failed (and its hold-down
                doubled) (UNAVAILABLE).
        """
        rec = self._membership.get(name)
        if rec is None or rec.state is not WorkerState.DEAD:
            return
        wait_s = self._membership.readmit_wait_s(name)
        if wait_s > 0:
            self._refused.inc()
            raise ReadmissionRefused(
                f"worker {name} was declared DEAD and is held down for {wait_s:.2f} s more "
                "(the hold-down doubles while it keeps failing, up to readmit_holddown_max_s); "
                f"retry in {wait_s:.2f} s",
                wait_s,
            )
        error = await probe_health(self._clients, name, address, self._timeout_s)
        if error is None:
            log.info("worker_readmitted", worker=name, address=address, holddown_s=rec.holddown_s)
            return
        hold_s = self._membership.readmit_refused(name)
        self._refused.inc()
        log.warning(
            "worker_readmission_refused",
            worker=name,
            address=address,
            reason=error,
            holddown_s=hold_s,
        )
        raise ReadmissionRefused(
            f"worker {name} was declared DEAD and the coordinator cannot reach it at {address} "
            f"({error}); held down for {hold_s:.2f} s (doubling while it keeps failing, up to "
            f"readmit_holddown_max_s): retry in {hold_s:.2f} s",
            hold_s,
        )
