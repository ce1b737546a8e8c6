"""The coordinator's dashboard in a real browser: headless Chromium (Debian's) via Playwright.

Starts a local cluster of real processes with a dashboard, opens the page and checks what a
person sees: three workers ALIVE, a train job's curves gaining points, a worker killed with
SIGKILL turning DEAD while the under-replicated count rises and comes back to 0. Every wait
is Playwright's (expect / wait_for_function with a deadline); nothing sleeps. The screenshot
goes to docs/dashboard.png (the README shows it).

Run with ``make test-browser``, which installs chromium when missing; never skipped.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from playwright.async_api import Page, async_playwright, expect

from shared.cli.local_cluster import LocalCluster
from shared.client import Client

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "dashboard.png"
# Fast failure detection: a killed worker is DEAD about a second later.
FAST = "heartbeat_interval_s: 0.2\nheartbeat_timeout_s: 1.0\n"
MEMORIES = 300_000  # enough that re-creating the lost copies takes a visible moment
TRAIN = {
    "kind": "train",
    "name": "digits-mlp",
    "workers": 3,
    "model": {"name": "mlp", "hidden": [64]},
    "data": "digits",
    "optimizer": {"name": "adam", "lr": 0.003},
    "epochs": 40,
    "batch_size": 32,
    "seed": 0,
}


def chromium_path() -> str:
    """Debian's chromium; a missing browser fails the test (make test-browser installs it)."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    pytest.fail("no chromium on PATH: run `make test-browser` (apt-get install -y chromium)")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    cfg = tmp_path / "coordinator.yaml"
    cfg.write_text(FAST)
    with LocalCluster(
        3,
        data_dir=tmp_path / "cluster",
        log_dir=tmp_path / "logs",
        coordinator_args=["--config", str(cfg)],
        dashboard=True,
    ) as c:
        yield c


async def _count(page: Page, selector: str) -> int:
    return int(await page.evaluate("s => document.querySelectorAll(s).length", selector))


async def _wait_count_above(page: Page, selector: str, n: int, timeout_ms: float) -> None:
    await page.wait_for_function(
        "([s, n]) => document.querySelectorAll(s).length > n", arg=[selector, n], timeout=timeout_ms
    )


async def test_dashboard_shows_workers_training_and_failover(cluster: LocalCluster) -> None:
    t0 = time.monotonic()
    url = cluster.dashboard_url
    assert url is not None
    async with Client(cluster.address) as client, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium_path(), headless=True)
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 1000})
            # Arrange: the page is up, live, and shows three workers ALIVE.
            await page.goto(url)
            await expect(page.locator("#conn")).to_have_text("live", timeout=15_000)
            states = page.locator("#workers tbody tr td.state")
            await expect(states).to_have_text(["ALIVE"] * 3, timeout=30_000)
            await expect(page.locator("#alive-count")).to_have_text("3 / 3")
            await expect(page.locator("#under-replicated")).to_have_text("0", timeout=30_000)

            # Memories in the store: the store panel shows their count and a top-10.
            rng = np.random.default_rng(0)
            ids = np.arange(1, MEMORIES + 1, dtype=np.uint64)
            for lo in range(0, MEMORIES, 50_000):
                await client.upsert(ids[lo : lo + 50_000], rng.random(50_000, dtype=np.float32))
            await expect(page.locator("#store-figures")).to_contain_text(
                f"count {MEMORIES}", timeout=30_000
            )
            await expect(page.locator("#topk tbody tr")).to_have_count(10)

            # Act: a train job; its accuracy curve gains points epoch after epoch.
            job = await client.submit(TRAIN)
            points = f'.job[data-job="{job.job_id}"] .acc-curve circle.pt'
            await _wait_count_above(page, points, 0, 120_000)
            first = await _count(page, points)
            await _wait_count_above(page, points, first, 120_000)
            await _wait_count_above(page, points, first + 1, 120_000)
            SCREENSHOT.parent.mkdir(exist_ok=True)
            await page.screenshot(path=str(SCREENSHOT), full_page=True)

            # Act: SIGKILL worker-2. Its row turns DEAD, the under-replicated count rises,
            # then the lost copies are re-created and it returns to 0.
            # The rise lasts as long as the copies take (a fraction of a second): watch for
            # it in the page (every animation frame) from before the kill.
            rise = asyncio.create_task(
                page.wait_for_function(
                    "() => Number(document.getElementById('under-replicated').textContent) > 0",
                    timeout=30_000,
                )
            )
            cluster.kill_worker(2)
            await rise
            row = page.locator('#workers tr[data-worker="worker-2"] td.state')
            await expect(row).to_have_text("DEAD", timeout=30_000)
            await expect(page.locator("#under-replicated")).to_have_text("0", timeout=90_000)
            await expect(page.locator("#alive-count")).to_have_text("2 / 3")
            await expect(page.locator('#events [data-kind="worker_dead"]')).to_contain_text(
                "worker-2 died"
            )
            await expect(page.locator('#events [data-kind="slots_copied"]').first).to_be_visible()
        finally:
            await browser.close()
    print(f"browser test: {time.monotonic() - t0:.1f} s")
