"""Job admission over gRPC: refused imports, paths and caps get their status, and nothing
happens (no job, no file, no import); an allowed model package trains."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from shared.client import NeuroshardError
from tests.fixtures import models

pytestmark = pytest.mark.integration


async def _refused(cluster, spec: dict) -> NeuroshardError:
    async with cluster.client() as client:
        with pytest.raises(NeuroshardError) as err:
            await client.submit(spec)
        assert await client.jobs() == []
    return err.value


async def test_an_import_not_allowed_runs_nothing(make_cluster, tmp_path: Path) -> None:
    cluster = await make_cluster(workers=1)
    marker = tmp_path / "pwned"
    spec = {
        "kind": "train",
        "model": {"import": "os:system", "args": {"command": f"touch {marker}"}},
        "steps": 1,
    }

    err = await _refused(cluster, spec)

    assert err.code is grpc.StatusCode.PERMISSION_DENIED
    assert "model.import: module 'os' is not in the coordinator's allowed_imports" in str(err)
    assert not marker.exists()


async def test_unlisted_packages_are_not_even_imported(make_cluster) -> None:
    cluster = await make_cluster(workers=1, allowed_imports=["tests.fixtures.other"])
    sys.modules.pop("tests.fixtures.unlisted", None)

    err = await _refused(
        cluster, {"kind": "train", "model": {"import": "tests.fixtures.unlisted:build"}}
    )

    assert err.code is grpc.StatusCode.PERMISSION_DENIED
    assert "tests.fixtures.unlisted" not in sys.modules


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("data", {"path": "/etc/passwd"}),
        ("data", {"path": "../../etc/passwd"}),
        ("load", "/etc/hostname"),
        ("access", {"trace": "../secret.npy"}),
    ],
)
async def test_paths_outside_the_data_roots_are_invalid(make_cluster, field, value) -> None:
    cluster = await make_cluster(workers=1)
    kind = "train" if field == "data" else "memory"

    err = await _refused(cluster, {"kind": kind, field: value})

    assert err.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "outside the coordinator's data roots" in str(err) or "must not contain '..'" in str(err)


@pytest.mark.parametrize(
    ("caps", "spec", "cap"),
    [
        ({"max_spec_bytes": 1024}, {"kind": "train", "name": "x" * 2000}, "max_spec_bytes"),
        ({"max_steps": 10}, {"kind": "train", "steps": 11}, "max_steps"),
        ({"max_model_params": 100}, {"kind": "train", "steps": 1}, "max_model_params"),
        (
            {"max_dataset_bytes": 2048},
            {"kind": "train", "data": {"name": "synthetic", "samples": 100}},
            "max_dataset_bytes",
        ),
        ({"max_memories_per_job": 10}, {"kind": "memory", "memories": 11}, "max_memories_per_job"),
    ],
)
async def test_every_cap_is_resource_exhausted(make_cluster, caps, spec, cap) -> None:
    cluster = await make_cluster(workers=1, **caps)

    err = await _refused(cluster, spec)

    assert err.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"exceeds the coordinator's {cap}" in str(err)


async def test_a_worker_that_does_not_allow_the_import_refuses_it(make_cluster) -> None:
    # The coordinator allows the package, the worker does not: the worker refuses before
    # importing, and the job fails naming the worker.
    cluster = await make_cluster(workers=1, allowed_imports=["tests.fixtures"])
    models.BUILDS.clear()
    spec = {"kind": "train", "model": {"import": "tests.fixtures.models:small_mlp"}, "steps": 2}

    async with cluster.client() as client:
        job = await client.wait((await client.submit(spec)).job_id)

    assert job.state == "FAILED"
    assert "not in the worker worker-0's allowed_imports" in job.error
    assert models.BUILDS["cpu"] == 1  # the parameter server's model; no worker replica


async def test_an_allowed_model_package_trains(make_cluster) -> None:
    allowed = {"allowed_imports": ["tests.fixtures"]}
    cluster = await make_cluster(workers=2, worker_overrides=allowed, **allowed)
    spec = {
        "kind": "train",
        "workers": 2,
        "model": {"import": "tests.fixtures.models:small_mlp", "args": {"hidden": 8}},
        "steps": 3,
    }

    async with cluster.client() as client:
        job = await client.wait((await client.submit(spec)).job_id)

    assert job.state == "SUCCEEDED", job.error
    assert job.result["steps"] == 3 and job.result["samples"] == 3 * 2 * 32
    assert np.isfinite(job.result["test_loss"])
