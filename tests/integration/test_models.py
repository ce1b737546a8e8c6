"""Models out and back in, through real daemons: ``GetModel``/``ListModels`` return the
coordinator's saved state dicts to their owner only, and ``init: {job: ID}`` starts a job of
any strategy from one, refused before queueing when a tensor does not fit."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from shared.client import Client, NeuroshardError
from shared.config import MlpSpec
from shared.training.models import build_model
from tests.integration.cli_helpers import run_cli
from tests.integration.security_helpers import Material

pytestmark = pytest.mark.integration

DIGITS_SHAPE, DIGITS_CLASSES = (1, 8, 8), 10


def tiny(**over: Any) -> dict[str, Any]:
    """A small digits MLP job on one worker."""
    spec: dict[str, Any] = {
        "kind": "train",
        "workers": 1,
        "model": {"name": "mlp", "hidden": [32]},
        "data": "digits",
        "optimizer": {"name": "adam", "lr": 0.003},
        "steps": 4,
        "batch_size": 64,
        "seed": 3,
        "health_threshold": 0.0,
    }
    return spec | over


def fresh_dir(tmp_path: Path) -> Path:
    """A directory of the client's files alone (the cluster's data dirs are in tmp_path)."""
    out = tmp_path / "client"
    out.mkdir()
    return out


def load(path: Path | str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert list(a) == list(b)
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=atol), name


async def run(client: Client, spec: dict[str, Any]) -> Any:
    job = await client.submit(spec)
    final = await client.wait(job.job_id)
    assert final.state == "SUCCEEDED", final.error
    return final


async def test_model_get_streams_the_saved_models_and_ls_lists_them(
    make_cluster, tmp_path: Path
) -> None:
    # Arrange: chunks of 4 KiB, so a model of ~10 KiB takes several messages. SGD at a high
    # lr: the last epoch is not the best one (seed-determined on one worker).
    cluster = await make_cluster(workers=1, chunk_bytes=4096)
    tmp_path = fresh_dir(tmp_path)
    spec = tiny(
        steps=None, epochs=4, batch_size=16, optimizer={"name": "sgd", "lr": 2.0, "momentum": 0.9}
    )
    models = Path(cluster.coordinator.cfg.data_dir) / "models"
    async with cluster.client() as client:
        final = await run(client, spec)
        job_id = final.job_id

        # Act
        got = await client.get_model(job_id, tmp_path / "final.pt")
        best = await client.get_model(job_id, tmp_path / "best.pt", best=True)
        listed = await client.list_models()

    # Assert: the coordinator's files, byte for byte, and a state dict of the spec's model
    saved = (models / f"{job_id}.pt").read_bytes()
    saved_best = (models / f"{job_id}.best.pt").read_bytes()
    assert (tmp_path / "final.pt").read_bytes() == saved
    assert (tmp_path / "best.pt").read_bytes() == saved_best
    assert (got["bytes"], best["bytes"]) == (len(saved), len(saved_best))
    assert got["bytes"] > 2 * 4096
    model = build_model(MlpSpec(hidden=[32]), DIGITS_SHAPE, DIGITS_CLASSES, 0)
    model.load_state_dict(load(tmp_path / "final.pt"))
    result = final.result
    assert result["best_test_accuracy"] > result["test_accuracy"]
    assert any(
        not torch.equal(a, b)
        for a, b in zip(
            load(tmp_path / "final.pt").values(), load(tmp_path / "best.pt").values(), strict=True
        )
    )
    assert [(m["job_id"], m["kind"], m["strategy"]) for m in listed] == [(job_id, "train", "sync")]
    assert listed[0]["best_test_accuracy"] == pytest.approx(result["best_test_accuracy"])
    assert (listed[0]["bytes"], listed[0]["best_bytes"]) == (len(saved), len(saved_best))
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "final.pt"]


async def test_init_from_a_job_starts_every_strategy_from_its_weights(make_cluster) -> None:
    # Arrange: job A trains; each B starts from A's final model and steps at lr 1e-12, so
    # B's final model equals A's unless B did not start from it.
    cluster = await make_cluster(workers=2)
    models = Path(cluster.coordinator.cfg.data_dir) / "models"
    still = {"optimizer": {"name": "sgd", "lr": 1e-12, "momentum": 0.0}, "steps": 2}
    async with cluster.client() as client:
        a = await run(client, tiny())
        start = load(models / f"{a.job_id}.pt")
        fresh = build_model(MlpSpec(hidden=[32]), DIGITS_SHAPE, DIGITS_CLASSES, 3).state_dict()
        assert not torch.allclose(start["1.weight"], fresh["1.weight"], atol=1e-3)

        # Act
        finals = {}
        for strategy in ("sync", "allreduce", "diloco"):
            extra = {"inner_steps": 2} if strategy == "diloco" else {}
            spec = tiny(strategy=strategy, workers=2, init={"job": a.job_id}, **still, **extra)
            finals[strategy] = await run(client, spec)

    # Assert
    for strategy, b in finals.items():
        assert_same(load(models / f"{b.job_id}.pt"), start, atol=1e-6)
        assert b.result["test_accuracy"] == pytest.approx(a.result["test_accuracy"]), strategy


async def test_a_misfit_or_unknown_init_is_refused_before_queueing(make_cluster) -> None:
    # Arrange: A's model is Flatten, Linear(64, 32), ReLU, Linear(32, 10), ReLU, Linear(10, 10)
    cluster = await make_cluster(workers=1)
    async with cluster.client() as client:
        a = await run(client, tiny(steps=1, model={"name": "mlp", "hidden": [32, 10]}))
        init = {"job": a.job_id}

        # Act
        refused = {}
        for name, spec in {
            "shape": tiny(model={"name": "mlp", "hidden": [16]}, init=init),
            "missing": tiny(model={"name": "mlp", "hidden": [32, 10, 10]}, init=init),
            "unexpected": tiny(model={"name": "mlp", "hidden": [32]}, init=init),
            "unknown": tiny(init={"job": "train-00000000"}),
            "path": tiny(init={"job": "../models/x"}),
        }.items():
            with pytest.raises(NeuroshardError) as info:
                await client.submit(spec)
            refused[name] = (info.value.code.name, str(info.value))
        jobs = await client.jobs()

    # Assert
    assert refused["shape"] == (
        "INVALID_ARGUMENT",
        "init.job: tensor '1.weight': expected shape [16, 64], found [32, 64]",
    )
    assert refused["missing"] == (
        "INVALID_ARGUMENT",
        "init.job: tensor '7.weight' (shape [10, 10]) is missing from the saved model",
    )
    assert refused["unexpected"] == (
        "INVALID_ARGUMENT",
        "init.job: unexpected tensor '5.weight' (shape [10, 10]) in the saved model",
    )
    assert refused["unknown"] == ("INVALID_ARGUMENT", "init.job: no job 'train-00000000'")
    assert refused["path"][0] == "INVALID_ARGUMENT"
    assert refused["path"][1].startswith("init.job:"), refused["path"]
    assert [j.job_id for j in jobs] == [a.job_id]  # nothing queued


async def test_init_from_an_uploaded_state_dict(make_cluster, tmp_path: Path) -> None:
    # Arrange: a state dict made here, uploaded as a data set; a torch.save of anything else
    # and a state dict of other shapes are refused.
    cluster = await make_cluster(workers=1)
    tmp_path = fresh_dir(tmp_path)
    mine = build_model(MlpSpec(hidden=[32]), DIGITS_SHAPE, DIGITS_CLASSES, 99).state_dict()
    torch.save(mine, tmp_path / "mine.pt")
    torch.save({"w": [1, 2, 3]}, tmp_path / "junk.pt")
    other = build_model(MlpSpec(hidden=[16]), DIGITS_SHAPE, DIGITS_CLASSES, 0).state_dict()
    torch.save(other, tmp_path / "other.pt")
    still = {"optimizer": {"name": "sgd", "lr": 1e-12, "momentum": 0.0}, "steps": 2}
    async with cluster.client() as client:
        stored = await client.put_dataset(tmp_path / "mine.pt", name="start")
        with pytest.raises(NeuroshardError) as junk:
            await client.put_dataset(tmp_path / "junk.pt")
        await client.put_dataset(tmp_path / "other.pt")
        listed = [e["path"] for e in await client.list_datasets()]

        # Act
        b = await run(client, tiny(init={"dataset": "start"}, **still))
        with pytest.raises(NeuroshardError) as misfit:
            await client.submit(tiny(init={"dataset": "other"}))
        with pytest.raises(NeuroshardError) as missing:
            await client.submit(tiny(init={"dataset": "nothing"}))

    # Assert
    assert (stored["name"], stored["path"], stored["kind"]) == ("start", "start.pt", "weights")
    assert [(a["name"], a["dtype"], a["shape"]) for a in stored["arrays"]][:1] == [
        ("1.weight", "float32", [32, 64])
    ]
    assert (junk.value.code.name, str(junk.value)) == (
        "INVALID_ARGUMENT",
        "junk.pt: not a state dict (a mapping of names to tensors)",
    )
    assert sorted(listed) == ["other.pt", "start.pt"]
    models = Path(cluster.coordinator.cfg.data_dir) / "models"
    assert_same(load(models / f"{b.job_id}.pt"), mine, atol=1e-6)
    assert (misfit.value.code.name, str(misfit.value)) == (
        "INVALID_ARGUMENT",
        "init.dataset: tensor '1.weight': expected shape [32, 64], found [16, 64]",
    )
    assert (missing.value.code.name, str(missing.value)) == (
        "INVALID_ARGUMENT",
        "init.dataset: no nothing.pt in the coordinator's data roots "
        "(neuroshard data put W.pt --name NAME)",
    )


async def test_models_are_their_owners_and_admins_only(
    secure, material: Material, tmp_path: Path
) -> None:
    # Arrange: alice trains a job
    cluster = await secure(workers=1)
    tmp_path = fresh_dir(tmp_path)

    def as_(role: str, who: str) -> Client:
        return Client(cluster.address, security=material.client(material.token(role, who)))

    async with as_("writer", "alice") as alice:
        a = await run(alice, tiny(steps=1))
        mine = await alice.list_models()

    # Act
    async with as_("writer", "bob") as bob:
        with pytest.raises(NeuroshardError) as got:
            await bob.get_model(a.job_id, tmp_path / "stolen.pt")
        with pytest.raises(NeuroshardError) as init:
            await bob.submit(tiny(init={"job": a.job_id}))
        bobs = await bob.list_models()
    async with as_("admin", "root") as admin:
        fetched = await admin.get_model(a.job_id, tmp_path / "admin.pt")
        admins = await admin.list_models()

    # Assert: bob gets the answer of an unknown job, and no file
    assert (got.value.code, str(got.value)) == (
        grpc.StatusCode.NOT_FOUND,
        f"no job with id {a.job_id!r}",
    )
    assert (init.value.code, str(init.value)) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        f"init.job: no job {a.job_id!r}",
    )
    assert os.listdir(tmp_path) == ["admin.pt"]
    assert [m["job_id"] for m in mine] == [m["job_id"] for m in admins] == [a.job_id]
    assert bobs == []
    assert fetched["bytes"] == (tmp_path / "admin.pt").stat().st_size


async def test_model_cli_get_and_ls(make_cluster, tmp_path: Path) -> None:
    cluster = await make_cluster(workers=1)
    tmp_path = fresh_dir(tmp_path)
    at = ("--coordinator", cluster.address)
    async with cluster.client() as client:
        a = await run(client, tiny(steps=1))
    out = tmp_path / "m.pt"

    got = await asyncio.to_thread(run_cli, "model", "get", a.job_id, "-o", str(out), *at)
    as_json = await asyncio.to_thread(
        run_cli, "model", "get", a.job_id, "--best", "-o", str(out), "--json", *at
    )
    listed = await asyncio.to_thread(run_cli, "model", "ls", "--json", *at)
    table = await asyncio.to_thread(run_cli, "model", *at, "ls")
    missing = await asyncio.to_thread(
        run_cli, "model", "get", "train-nope", "-o", str(tmp_path / "n.pt"), *at
    )

    assert got.returncode == 0, got.stderr
    assert got.stdout.startswith(f"wrote {out}: final model of {a.job_id}, ")
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert (doc["job_id"], doc["best"], doc["path"]) == (a.job_id, True, str(out))
    best = Path(cluster.coordinator.cfg.data_dir) / "models" / f"{a.job_id}.best.pt"
    assert out.read_bytes() == best.read_bytes()
    assert listed.returncode == 0, listed.stderr
    assert [m["job_id"] for m in json.loads(listed.stdout)] == [a.job_id]
    assert table.returncode == 0 and a.job_id in table.stdout
    assert missing.returncode == 1
    assert missing.stderr.strip() == "error: no job with id 'train-nope'"
    assert os.listdir(tmp_path) == ["m.pt"]
