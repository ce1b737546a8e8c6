"""Every metric ``shared/metrics.py`` declares is set by the daemons' own code
(docs/architecture.md, "Invariants").

A real in-process coordinator and two workers serve memory operations and a short training
job; then every declared ``neuroshard_*`` family must have a sample with a non-zero value
(a histogram: a non-zero ``_count``) in at least one daemon's registry, the one its
``/metrics`` endpoint serves. A declared metric that no code path sets fails this test (an
unlabelled gauge or counter is exposed at 0 without ever being touched, so being exposed is
not enough). ``tests/unit/shared/test_metrics_exposition.py`` checks names, docs and the
dashboard on a synthetic, fully populated ``Metrics``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shared.metrics import Metrics

pytestmark = pytest.mark.integration

# Declared but set by no production code yet (docs/metrics.md says so); listed here so the
# gap is visible, and so this test fails as soon as one of them is set (drop it from here).
NOT_YET_SET: dict[str, str] = {}
# Set only by events this test does not provoke (a flapping worker, a client's report a probe
# does not confirm, slots copied to a worker that joins a loaded cluster): the file named
# reads the metric in tests that provoke them (checked below by its name appearing there).
SET_BY_OTHER_TESTS: dict[str, str] = {
    "neuroshard_readmissions_refused": "test_flapping.py",
    "neuroshard_worker_suspicions_unconfirmed": "test_failover_reports.py",
    "neuroshard_slot_copy_requests": "memory_helpers.py",  # test_memory, test_failover
    # a file data set's shards (this test trains on a built-in set)
    "neuroshard_shard_rows": "test_data_files.py",
    "neuroshard_shard_fetched_bytes": "test_data_files.py",
}


def families(registry: CollectorRegistry) -> dict[str, list]:
    """``{family name: samples}`` parsed from the registry's exposition text (counters by
    their family name, without ``_total``), leaving out prometheus_client's ``*_created``
    companions (families of their own in the text format, samples in others)."""
    text = generate_latest(registry).decode()
    return {
        f.name: [s for s in f.samples if not s.name.endswith("_created")]
        for f in text_string_to_metric_families(text)
        if not f.name.endswith("_created")
    }


def is_set(samples: list) -> bool:
    """Whether a family shows a value some code must have put there."""
    counts = [s for s in samples if s.name.endswith("_count")]
    return any(s.value != 0 for s in (counts or samples))


async def test_every_declared_metric_is_set_by_the_daemons(make_cluster) -> None:
    # Arrange
    declared = set(families(Metrics().registry))
    assert len(declared) >= 10 and all(n.startswith("neuroshard_") for n in declared)
    cluster = await make_cluster(workers=2, slots=16)

    # Act: memory operations, a two-step training job and a one-iteration memory job
    # (neuroshard_convergence_ratio) through the public client.
    ids = np.arange(200, dtype=np.uint64)
    async with cluster.client() as client:
        await client.wait_ready()
        await client.upsert(ids, np.full(200, 0.5, np.float32))
        await client.reinforce(ids[:50], np.full(50, 0.25, np.float32))
        await client.decay(0.1)
        await client.get(ids[:10])
        await client.quality()
        await client.topk(5)
        job = await client.submit({"kind": "train", "workers": 1, "steps": 2})
        final = await client.wait(job.job_id)
        mem = await client.submit(
            {"kind": "memory", "memories": 300, "iterations": 1, "access": {"batch": 50}}
        )
        mem_final = await client.wait(mem.job_id)
    assert final.state == "SUCCEEDED", final.error
    assert mem_final.state == "SUCCEEDED", mem_final.error
    registries = [cluster.coordinator.metrics.registry] + [
        w.metrics.registry for w in cluster.workers
    ]
    set_somewhere = {
        name
        for registry in registries
        for name, samples in families(registry).items()
        if is_set(samples)
    }

    # Assert
    unset = declared - set_somewhere
    assert unset - set(NOT_YET_SET) - set(SET_BY_OTHER_TESTS) == set(), "declared, never set"
    for name, test in SET_BY_OTHER_TESTS.items():
        assert f"{name}_total" in (Path(__file__).parent / test).read_text(), test
    assert set(NOT_YET_SET) - unset == set(), "set now: remove them from NOT_YET_SET"
