"""Every panel of the Grafana dashboard shows data from a real Prometheus scraping a cluster.

A real Prometheus server (Debian's ``prometheus``) scrapes an in-process coordinator and two
workers, each serving ``/metrics`` on a free port, every second. While memory operations,
a refused call and short ``sync`` training jobs run, the test asks Prometheus's HTTP API for
every ``expr`` of every panel of ``deploy/grafana/neuroshard.json`` (Grafana's variables
substituted) until each one returns at least one series with a finite value: what a panel
needs to draw something rather than "No data". A query of a metric the daemons declare but
never set, or never expose, fails here with its panel's title.

``make test`` installs the ``prometheus`` package when it is missing; outside CI the test is
skipped without it, in CI (``CI`` set) it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from shared.client import NeuroshardError

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "neuroshard.json"
PROMETHEUS = shutil.which("prometheus")
DEADLINE_S = 90.0
# Grafana's built-in variables as a dashboard at a 1 s scrape interval would see them; the
# rate window spans many scrapes, so a series needs two samples in it, not a lucky pair.
GRAFANA_VARIABLES = {
    "$__rate_interval": "30s",
    "${__rate_interval}": "30s",
    "$__interval": "5s",
    "${__interval}": "5s",
    "$__range": "5m",
}


def panel_queries() -> list[tuple[str, str]]:
    """``(panel title, expr)`` of every target of every panel, rows' panels included,
    with Grafana's variables substituted."""
    found: list[tuple[str, str]] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                expr = target.get("expr", "")
                for name, value in GRAFANA_VARIABLES.items():
                    expr = expr.replace(name, value)
                assert "$" not in expr, f"unknown variable in {panel.get('title')!r}: {expr}"
                if expr:
                    found.append((str(panel.get("title")), expr))

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return found


def free_port() -> int:
    """A port free on loopback now (Prometheus cannot bind port 0 and report it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.load(reply)


def has_data(result: dict[str, Any]) -> bool:
    """Whether an instant query's answer holds a series with a finite value."""
    if result.get("status") != "success":
        return False
    rows = result["data"]["result"]
    return any(math.isfinite(float(row["value"][1])) for row in rows)


@contextlib.contextmanager
def prometheus(tmp_path: Path, targets: list[str]) -> Iterator[str]:
    """Run Prometheus scraping ``targets`` every second; yield its base URL; kill it."""
    assert PROMETHEUS is not None
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: neuroshard\n    static_configs:\n"
        f"      - targets: {json.dumps(targets)}\n"
    )
    port = free_port()
    log_path = tmp_path / "prometheus.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        try:
            yield f"http://127.0.0.1:{port}"
        except BaseException:
            print(log_path.read_text()[-4000:])  # shown by pytest with the failure
            raise
        finally:
            proc.kill()
            proc.wait(timeout=10)


async def wait_ready(url: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            await asyncio.to_thread(http_json, f"{url}/api/v1/status/buildinfo")
            return
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


DATA_FILE = "rows.npz"


async def drive(cluster: Any, stop: asyncio.Event) -> None:
    """A memory job, then memory operations, a refused call and short training jobs, until
    ``stop``.

    In rounds, so every counter grows between scrapes and rates over the window are real. The
    jobs train on a file data set (``DATA_FILE`` in the cluster's data root), so the workers'
    shard rows are counted too (fetched by the first job, from their cache after).
    """
    ids = np.arange(300, dtype=np.uint64)
    job = None
    async with cluster.client() as client:
        await client.wait_ready()
        # One short memory job: its convergence gauge keeps the value of its last iteration.
        mem = await client.wait(
            (
                await client.submit(
                    {"kind": "memory", "memories": 300, "iterations": 2, "access": {"batch": 50}}
                )
            ).job_id
        )
        assert mem.state == "SUCCEEDED", mem.error
        while not stop.is_set():
            await client.upsert(ids, np.full(len(ids), 0.5, np.float32))
            await client.reinforce(ids[:100], np.full(100, 0.1, np.float32))
            await client.get(ids[:20])
            await client.delete(ids[-5:])
            await client.decay(0.01)
            await client.quality()
            await client.topk(5)
            with pytest.raises(NeuroshardError):  # feeds the error-ratio panel: NOT_FOUND
                await client.get_job("no-such-job")
            if job is None or (await client.get_job(job.job_id)).state not in (
                "QUEUED",
                "RUNNING",
            ):
                if job is not None:
                    final = await client.get_job(job.job_id)
                    assert final.state == "SUCCEEDED", final.error
                job = await client.submit(
                    {"kind": "train", "workers": 2, "steps": 20, "data": {"path": DATA_FILE}}
                )
            await asyncio.sleep(0.3)


async def test_every_dashboard_panel_has_data_in_a_real_prometheus(
    make_cluster, tmp_path: Path
) -> None:
    if PROMETHEUS is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is not installed: `make test` installs it (make test-deps)")
        pytest.skip("no prometheus binary (apt-get install prometheus, or make test-deps)")
    # Arrange: a cluster whose every daemon serves /metrics on a free port, and Prometheus.
    queries = panel_queries()
    assert len(queries) >= 20
    root = tmp_path / "data"
    root.mkdir()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 8)).astype(np.float32)
    np.savez(root / DATA_FILE, x=x, y=(x[:, 0] > 0).astype(np.int64))
    cluster = await make_cluster(
        workers=2,
        slots=16,
        metrics_port=0,
        worker_overrides={"metrics_port": 0},
        data_roots=[str(root)],
    )
    ports = [cluster.coordinator.metrics_port] + [w.metrics_port for w in cluster.workers]
    assert all(ports), ports
    stop = asyncio.Event()
    with prometheus(tmp_path, [f"127.0.0.1:{p}" for p in ports]) as url:
        await wait_ready(url)
        driver = asyncio.create_task(drive(cluster, stop))
        try:
            # Act: ask every query until each has data, or the deadline passes.
            missing = set(queries)
            started = time.monotonic()
            while missing and time.monotonic() - started < DEADLINE_S and not driver.done():
                await asyncio.sleep(1.0)
                for title, expr in sorted(missing):
                    q = urllib.parse.urlencode({"query": expr})
                    if has_data(await asyncio.to_thread(http_json, f"{url}/api/v1/query?{q}")):
                        missing.discard((title, expr))
        finally:
            stop.set()
            await driver  # re-raises what failed in the traffic

        # Assert
        targets = await asyncio.to_thread(http_json, f"{url}/api/v1/targets")
        health = [t["health"] for t in targets["data"]["activeTargets"]]
        assert health == ["up"] * len(ports), targets
        titles = sorted({title for title, _ in missing})
        assert not missing, f"panels without data after {DEADLINE_S} s: {titles}: {missing}"
        print(f"every panel had data after {time.monotonic() - started:.1f} s")
