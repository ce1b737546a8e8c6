"""Job admission over gRPC: refused entry points, paths and caps get their status, and nothing
happens (no job, no file, no import, no memory); a listed entry point trains."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from shared.client import NeuroshardError
from shared.config import MlpSpec
from shared.training.models import activation_bytes, build_model
from tests.fixtures import ALLOWED_MODELS, models

pytestmark = pytest.mark.integration


async def _refused(cluster, spec: dict) -> NeuroshardError:
    async with cluster.client() as client:
        with pytest.raises(NeuroshardError) as err:
            await client.submit(spec)
        assert await client.jobs() == []
    return err.value


V = "tests.fixtures.vision"


async def test_the_os_system_attack_through_an_allowed_module_runs_nothing(
    make_cluster, tmp_path: Path
) -> None:
    # The operator lists a model of tests.fixtures.vision, a module that imports os; the old
    # import form walked from there to os.system and ran the command during admission.
    cluster = await make_cluster(workers=0, allowed_models={"tiny": f"{V}:tiny_linear"})
    marker = tmp_path / "pwned"
    spec = {
        "kind": "train",
        "model": {"import": f"{V}:os.system", "args": {"command": f"touch {marker}"}},
        "steps": 1,
    }

    err = await _refused(cluster, spec)

    assert err.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "model: 'import' is no longer accepted; name an entry point the operator listed " in (
        str(err)
    )
    assert not marker.exists()


async def test_an_entry_the_operator_mislisted_as_an_imported_name_runs_nothing(
    make_cluster, tmp_path: Path
) -> None:
    # tests/fixtures/vision.py has `from os import system`: listing it must not make it code a
    # spec may call.
    cluster = await make_cluster(workers=0, allowed_models={"evil": f"{V}:system"})
    marker = tmp_path / "pwned"
    spec = {"kind": "train", "model": {"entry": "evil", "args": {"command": f"touch {marker}"}}}

    err = await _refused(cluster, spec)

    assert err.code is grpc.StatusCode.PERMISSION_DENIED
    assert (
        f"model.entry: 'evil' ({V}:system): builtin_function_or_method is not a function or "
        f"class defined in {V}"
    ) in str(err)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("model", "code", "message"),
    [
        (
            {"entry": "vision.os"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "model.entry: expected the name of an entry point listed in allowed_models",
        ),
        (
            {"entry": "__class__"},
            grpc.StatusCode.INVALID_ARGUMENT,
            "model.entry: expected the name of an entry point listed in allowed_models",
        ),
        (
            {"entry": "small_mlp"},  # listed, but defined in tests.fixtures.models
            grpc.StatusCode.PERMISSION_DENIED,
            f"model.entry: 'small_mlp' ({V}:small_mlp): 'small_mlp' is defined in "
            f"'tests.fixtures.models', not in {V}",
        ),
        (
            {"entry": "os_module"},  # `import os` in the module
            grpc.StatusCode.PERMISSION_DENIED,
            f"model.entry: 'os_module' ({V}:os): module is not a function or class defined",
        ),
        (
            {"entry": "unlisted"},
            grpc.StatusCode.PERMISSION_DENIED,
            "model.entry: 'unlisted' is not in the coordinator's allowed_models (listed: "
            "os_module, small_mlp, tiny)",
        ),
        (
            {"entry": "tiny", "args": {"features": 64, "command": "id"}},
            grpc.StatusCode.INVALID_ARGUMENT,
            f"model.entry: 'tiny' ({V}:tiny_linear): unknown argument 'command' in args",
        ),
        (
            {"entry": "tiny", "args": {"classes": 10}},
            grpc.StatusCode.INVALID_ARGUMENT,
            f"model.entry: 'tiny' ({V}:tiny_linear): missing required argument 'features'",
        ),
    ],
)
async def test_entries_are_refused_with_their_status_and_reason(
    make_cluster, model, code, message
) -> None:
    listed = {"tiny": f"{V}:tiny_linear", "small_mlp": f"{V}:small_mlp", "os_module": f"{V}:os"}
    cluster = await make_cluster(workers=0, allowed_models=listed)

    err = await _refused(cluster, {"kind": "train", "model": model, "steps": 1})

    assert err.code is code
    assert message in str(err)


async def test_unlisted_entries_are_not_even_imported(make_cluster) -> None:
    cluster = await make_cluster(workers=0, allowed_models={"other": "tests.fixtures.other:b"})
    sys.modules.pop("tests.fixtures.unlisted", None)

    err = await _refused(cluster, {"kind": "train", "model": {"entry": "build"}})

    assert err.code is grpc.StatusCode.PERMISSION_DENIED
    assert "tests.fixtures.unlisted" not in sys.modules
    assert "tests.fixtures.other" not in sys.modules


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


def _rss_bytes() -> int:
    """This process's resident set size (the in-process coordinator's), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


# Small specs that made the daemons allocate gigabytes (issue 19, finding 6), refused by the
# default caps: (spec, status, the message's start, the cap it names).
ALLOCATION_ATTACKS = {
    "synthetic class centres and samples": (
        {
            "kind": "train",
            "data": {"name": "synthetic", "samples": 20000, "features": 5000, "classes": 20000},
            "steps": 1,
        },
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "data: 2000160000 bytes to generate (samples 20000, features 5000, classes 20000) "
        "exceeds the coordinator's max_synthetic_bytes 1073741824 bytes",
    ),
    "more classes than samples (the issue's 207-byte spec)": (
        {"kind": "train", "data": {"name": "synthetic", "classes": 20000, "features": 5000}},
        grpc.StatusCode.INVALID_ARGUMENT,
        "data: classes: 20000 is more than samples (2000)",
    ),
    "one micro-batch's activations": (
        {"kind": "train", "model": {"name": "mlp", "hidden": [65536]}, "batch_size": 65536},
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "batch_size: 34395914240 bytes of activations for 65536 rows exceeds the "
        "coordinator's max_activation_bytes 1073741824 bytes",
    ),
    "a memory job's access batch": (
        {"kind": "memory", "memories": 10, "access": {"batch": 10_000_000}},
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "access.batch: 960000000 bytes for 10000000 accesses exceeds the coordinator's "
        "max_access_batch_bytes 268435456 bytes",
    ),
}


@pytest.mark.parametrize("attack", list(ALLOCATION_ATTACKS))
async def test_small_specs_that_would_allocate_gigabytes_are_refused(make_cluster, attack) -> None:
    spec, code, message = ALLOCATION_ATTACKS[attack]
    # No worker: were the spec admitted, its job would wait instead of allocating gigabytes.
    cluster = await make_cluster(workers=0)
    async with cluster.client() as client:  # warm up the RPC path before measuring
        await client.jobs()
    # The first forward pass on the meta device imports torch's meta kernels (~75 MB, once per
    # process, whatever the model): done before measuring what a spec costs.
    activation_bytes(build_model(MlpSpec(hidden=[2]), (4,), 2, seed=0, device="meta"), (4,), 1)
    before = _rss_bytes()

    err = await _refused(cluster, spec)

    assert err.code is code
    assert message in str(err)
    assert _rss_bytes() - before < 50 * 2**20


async def test_a_worker_that_does_not_list_the_entry_refuses_it(make_cluster) -> None:
    # The coordinator lists the entry, the worker does not: the worker refuses before
    # importing, and the job fails naming the worker.
    cluster = await make_cluster(workers=1, allowed_models=ALLOWED_MODELS)
    models.BUILDS.clear()
    spec = {"kind": "train", "model": {"entry": "small_mlp"}, "steps": 2}

    async with cluster.client() as client:
        job = await client.wait((await client.submit(spec)).job_id)

    assert job.state == "FAILED"
    assert "model.entry: 'small_mlp' is not in the worker worker-0's allowed_models" in job.error
    assert models.BUILDS["cpu"] == 1  # the parameter server's model; no worker replica


async def test_a_listed_entry_trains(make_cluster) -> None:
    allowed = {"allowed_models": ALLOWED_MODELS}
    cluster = await make_cluster(workers=2, worker_overrides=allowed, **allowed)
    spec = {
        "kind": "train",
        "workers": 2,
        "model": {"entry": "small_mlp", "args": {"hidden": 8}},
        "steps": 3,
    }

    async with cluster.client() as client:
        job = await client.wait((await client.submit(spec)).job_id)

    assert job.state == "SUCCEEDED", job.error
    assert job.result["steps"] == 3 and job.result["samples"] == 3 * 2 * 32
    assert np.isfinite(job.result["test_loss"])
