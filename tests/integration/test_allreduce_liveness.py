"""An allreduce generation never waits forever on a rank that stalls (issue: sure-under-load).

Through real daemons: at generation 0's rendezvous one rank's training process is stopped
(SIGSTOP; its worker daemon stays ALIVE and heartbeats, so the coordinator never declares it
DEAD). Stopping rank 0 stops the store the others dial, as a hung store host did in CI;
stopping rank 1 leaves rank 0 waiting for it to join. The other rank's wait times out after
``collective_timeout_s`` and it ends; the stalled rank neither joins nor ends, and the
coordinator gives up on it within ``Generation.liveness_s`` of that end, so generation 1
(the other worker alone) trains the job to its single-process reference.

Stopping rank 0 also showed why a rank could hang in generation start: torch's store client
waits for the store's answer to its first ping without a deadline, and a stopped host's
kernel accepts the connection for it; ``client_store`` bounds that wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import signal
import socket
import time
from typing import Any

import pytest

from coordinator.training.allreduce_generation import Generation
from tests.integration.test_allreduce import _max_diff, _spec, reference_params
from tests.integration.test_allreduce_rendezvous import _children, _listening
from worker.allreduce.rendezvous_store import client_store

pytestmark = pytest.mark.integration

TIMEOUT_S = 3.0  # the job's collective_timeout_s: the rendezvous gives up after this
# Generation 0 ends within TIMEOUT_S + liveness_s (16 s) of the rendezvous; the rest is
# start-up and 20 steps of one rank. Without the liveness rule the job never ends.
JOB_BOUND_S = 200.0


def _stall_at_rendezvous(monkeypatch: pytest.MonkeyPatch, stalled_rank: int) -> list[int]:
    """At generation 0's rendezvous, once rank 0's store is up and before rank 1 is told
    where it is, stop (SIGSTOP) one rank's training process; returns the stopped pids."""
    stopped: list[int] = []
    rendezvous = Generation._rendezvous_rank0

    async def stall(self: Generation) -> int | None:
        port = await rendezvous(self)
        if self.plan.number == 0 and port is not None:
            rank0 = [pid for pid in _children() if port in [p for _, p in _listening(pid)]]
            others = [pid for pid in _children() if pid not in rank0]
            (pid,) = rank0 if stalled_rank == 0 else others
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        return port

    monkeypatch.setattr(Generation, "_rendezvous_rank0", stall)
    return stopped


async def _run(make_cluster: Any, spec: dict[str, Any], stopped: list[int]) -> Any:
    """The job on a fresh 2-worker cluster, to its end; the stopped pids let go after."""
    cluster = await make_cluster(workers=2)
    try:
        async with cluster.client() as client:
            job = await client.submit(spec)
            async with asyncio.timeout(JOB_BOUND_S):
                return await client.wait(job.job_id)
    finally:
        for pid in stopped:  # its worker killed it; should the test fail, let it go on
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("stalled_rank", [0, 1])
async def test_a_stalled_rank_is_given_up_on_and_the_next_generation_trains(
    make_cluster, monkeypatch: pytest.MonkeyPatch, stalled_rank: int
) -> None:
    # Arrange: 2 workers, 1 enough; one rank's child stopped at generation 0's rendezvous.
    spec = _spec(2, min_workers=1, collective_timeout_s=TIMEOUT_S)
    stopped = _stall_at_rendezvous(monkeypatch, stalled_rank)

    # Act
    final = await _run(make_cluster, spec, stopped)

    # Assert: the stalled rank failed generation 0 and sat out; the other trained alone.
    assert len(stopped) == 1
    assert final.state == "SUCCEEDED", final.error
    result = final.result
    assert result["generations"] == 2 and result["worker_failures"] == 1
    assert sorted(g["generations"] for g in result["workers"].values()) == [1, 2]
    assert _max_diff(result["model_path"], reference_params(spec)) < 1e-5
    # The stopped child was killed by its worker, not left behind.
    assert stopped[0] not in _children()


async def test_a_job_that_needs_the_failed_worker_takes_it_back_once_it_is_alive(
    make_cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange: 2 workers and both needed (min_workers = workers); rank 1's child stopped at
    # generation 0's rendezvous while its worker daemon stays ALIVE (as a worker declared
    # DEAD under load and readmitted at once). Before, the job left the failed worker out
    # of every generation and failed after queue_timeout_s for want of a second worker.
    spec = _spec(2, collective_timeout_s=TIMEOUT_S)
    stopped = _stall_at_rendezvous(monkeypatch, 1)

    # Act
    final = await _run(make_cluster, spec, stopped)

    # Assert: generation 1 had both workers again and trained the job to its reference.
    assert len(stopped) == 1
    assert final.state == "SUCCEEDED", final.error
    result = final.result
    assert result["generations"] == 2 and result["worker_failures"] == 1
    assert sorted(g["generations"] for g in result["workers"].values()) == [2, 2]
    assert _max_diff(result["model_path"], reference_params(spec)) < 1e-5


def test_a_store_that_accepts_but_never_answers_times_its_client_out() -> None:
    # Arrange: a listening socket nobody accepts on, as a stopped store host's (the kernel
    # completes the connection from the backlog; nothing ever answers torch's ping).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        t0 = time.monotonic()

        # Act / Assert: the client gives up after the timeout instead of waiting forever.
        with pytest.raises(TimeoutError, match=f"store at 127.0.0.1:{port} did not answer"):
            client_store("127.0.0.1", port, datetime.timedelta(seconds=1))
        assert time.monotonic() - t0 < 10


def test_a_store_that_answers_gives_a_working_client() -> None:
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    host = TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=5))
    client = client_store("127.0.0.1", host.port, datetime.timedelta(seconds=5))
    client.set("k", b"v")
    assert host.get("k") == b"v"
