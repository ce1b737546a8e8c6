"""Admission: every cap, entry-point and path refusal happens before a job exists, and names
the key, the value and the cap."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.cluster import Cluster
from coordinator.jobs.admission import LimitExceeded, admit
from shared.config import ConfigError, CoordinatorConfig
from shared.metrics import Metrics
from shared.security.confinement import PathRefused
from shared.training.entry_points import EntryPointRefused


def _cfg(tmp_path: Path, **caps: Any) -> CoordinatorConfig:
    root = tmp_path / "root"
    root.mkdir(exist_ok=True)
    return CoordinatorConfig(
        data_dir=str(tmp_path / "coord"), data_roots=[str(root)], metrics_port=None, **caps
    )


def _train(**kw: Any) -> str:
    return json.dumps({"kind": "train", "workers": 1, **kw})


def _memory(**kw: Any) -> str:
    return json.dumps({"kind": "memory", "workers": 1, **kw})


@pytest.mark.parametrize(
    ("caps", "spec", "message"),
    [
        (
            {"max_spec_bytes": 1024},
            _train(name="x" * 100, model={"name": "mlp", "hidden": [1] * 400}),
            r"^spec: \d+ bytes exceeds the coordinator's max_spec_bytes 1024 bytes$",
        ),
        (
            {"max_model_params": 1000},
            _train(model={"name": "mlp", "hidden": [32]}),
            # digits: 64 inputs, 10 classes: 64*32 + 32 + 32*10 + 10
            r"^model: 2410 parameters exceeds the coordinator's max_model_params 1000",
        ),
        (
            {"max_model_params": 1000},
            _train(model={"name": "cnn", "channels": [16, 32]}),
            r"^model: \d+ parameters exceeds the coordinator's max_model_params 1000",
        ),
        (
            {"max_steps": 100},
            _train(steps=101),
            r"^steps: 101 steps exceeds the coordinator's max_steps 100 steps$",
        ),
        (
            {"max_steps": 100},
            _train(epochs=10, batch_size=32),  # 1437 training rows: 45 steps per epoch
            r"^epochs: 450 steps exceeds the coordinator's max_steps 100 steps$",
        ),
        (
            {"max_dataset_bytes": 4096},
            _train(data={"name": "synthetic", "samples": 100, "features": 64}),
            r"^data.samples: 25600 bytes exceeds the coordinator's max_dataset_bytes 4096 bytes",
        ),
        (
            {"max_synthetic_bytes": 4_000_000},
            _train(data={"name": "synthetic", "samples": 200, "features": 1000, "classes": 200}),
            # centres 8 x 200 x 1000 + samples 12 x 200 x 1000 + labels 8 x 200
            r"^data: 4001600 bytes to generate \(samples 200, features 1000, classes 200\) "
            r"exceeds the coordinator's "
            r"max_synthetic_bytes 4000000 bytes$",
        ),
        (
            {},  # the spec, with samples raised so that every class has one
            _train(
                data={"name": "synthetic", "samples": 20000, "features": 5000, "classes": 20000}
            ),
            r"^data: 2000160000 bytes to generate \(samples 20000, features 5000, classes "
            r"20000\) exceeds the coordinator's "
            r"max_synthetic_bytes 1073741824 bytes$",
        ),
        (
            {"max_activation_bytes": 1 << 20},
            _train(model={"name": "mlp", "hidden": [1024]}, batch_size=512),
            # digits: input 64 + Flatten 64 + Linear 1024 + ReLU 1024 + Linear 10, float32
            r"^batch_size: 4476928 bytes of activations for 512 rows exceeds the "
            r"coordinator's max_activation_bytes 1048576 bytes$",
        ),
        (
            {},
            _memory(memories=10, access={"batch": 10_000_000}),
            r"^access.batch: 960000000 bytes for 10000000 accesses exceeds the coordinator's "
            r"max_access_batch_bytes 268435456 bytes$",
        ),
        (
            {"max_memories_per_job": 1000},
            _memory(memories=1001),
            r"^memories: 1001 exceeds the coordinator's max_memories_per_job 1000$",
        ),
        (
            {"max_steps": 10},
            _memory(memories=10, iterations=11),
            r"^iterations: 11 exceeds the coordinator's max_steps 10$",
        ),
    ],
)
def test_every_cap_is_enforced_with_its_name(
    tmp_path: Path, caps: dict[str, Any], spec: str, message: str
) -> None:
    cfg = _cfg(tmp_path, **caps)

    with pytest.raises(LimitExceeded, match=message):
        admit(spec, cfg)


def test_file_caps_count_bytes_and_memories_from_headers(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, max_dataset_bytes=4096, max_memories_per_job=100)
    root = cfg.dataset_roots()[0]
    np.savez(root / "big.npz", x=np.zeros((100, 64), np.float32), y=np.zeros(100, np.int64))
    np.savez(root / "mem.npz", ids=np.arange(101, dtype=np.uint64), strengths=np.zeros(101))

    with pytest.raises(LimitExceeded, match=r"^data.path: \d+ bytes exceeds .*max_dataset_bytes"):
        admit(_train(data={"path": "big.npz"}), cfg)
    with pytest.raises(LimitExceeded, match="^load: 101 memories exceeds .*max_memories_per_job"):
        admit(_memory(load="mem.npz"), cfg)


def test_a_file_data_set_is_admitted_from_its_headers(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, max_model_params=64 * 8 + 8 + 8 * 3 + 3)
    root = cfg.dataset_roots()[0]
    np.savez(root / "d.npz", x=np.zeros((50, 64), np.float32), y=np.arange(50, dtype=np.int64) % 3)

    spec = admit(_train(data={"path": "d.npz"}, model={"name": "mlp", "hidden": [8]}), cfg)

    assert spec.kind == "train"


def test_entries_are_refused_before_anything_is_imported(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, allowed_models={"other": "neuroshard_no_such_pkg.evil:build"})

    with pytest.raises(EntryPointRefused, match="^model.entry: 'evil' is not in the coordinator"):
        admit(_train(model={"entry": "evil", "args": {}}), cfg)
    with pytest.raises(ConfigError, match="^model: 'import' is no longer accepted"):
        admit(_train(model={"import": "os:system", "args": {"command": "touch x"}}), cfg)

    assert "neuroshard_no_such_pkg" not in sys.modules


def test_entry_args_are_checked_against_the_signature(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, allowed_models={"tiny": "tests.fixtures.vision:tiny_linear"})

    with pytest.raises(ConfigError, match="^model.entry: 'tiny' .*unknown argument 'command'"):
        admit(_train(model={"entry": "tiny", "args": {"features": 64, "command": "x"}}), cfg)
    admit(_train(model={"entry": "tiny", "args": {"features": 64}}), cfg)


@pytest.mark.parametrize(
    "path",
    ["/etc/passwd", "../elsewhere.npz", "sub/../../elsewhere.npz", "/tmp/../etc/passwd"],
)
def test_paths_outside_the_roots_get_the_same_answer_whether_or_not_they_exist(
    tmp_path: Path, path: str
) -> None:
    cfg = _cfg(tmp_path)
    (tmp_path / "elsewhere.npz").write_bytes(b"PK")
    absent = path.replace("passwd", "nope").replace("elsewhere", "nope")

    with pytest.raises(PathRefused) as existing:
        admit(_train(data={"path": path}), cfg)
    with pytest.raises(PathRefused) as missing:
        admit(_train(data={"path": absent}), cfg)

    assert str(existing.value).replace(path, "P") == str(missing.value).replace(absent, "P")


def test_a_symlink_leaving_the_root_is_refused(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    root = cfg.dataset_roots()[0]
    secret = tmp_path / "secret.npz"
    np.savez(secret, x=np.zeros((10, 2), np.float32), y=np.arange(10, dtype=np.int64) % 2)
    os.symlink(secret, root / "link.npz")
    os.symlink(tmp_path, root / "dir")

    for path in ("link.npz", "dir/secret.npz", str(root / "link.npz")):
        with pytest.raises(PathRefused, match="is outside the coordinator's data roots"):
            admit(_train(data={"path": path}), cfg)
    with pytest.raises(PathRefused):
        admit(_memory(access={"trace": "link.npz"}), cfg)


def test_missing_files_inside_the_roots_are_invalid(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)

    with pytest.raises(ConfigError, match="^load: no file 'gone.npz' in the coordinator's"):
        admit(_memory(load="gone.npz"), cfg)


async def test_a_refused_spec_queues_no_job(tmp_path: Path) -> None:
    cluster = Cluster(_cfg(tmp_path, max_steps=5), Metrics())
    try:
        for spec, error in [
            (_train(steps=6), LimitExceeded),
            (_train(model={"entry": "system"}), EntryPointRefused),
            (_train(data={"path": "/etc/passwd"}), PathRefused),
            ("{not json", ConfigError),
        ]:
            with pytest.raises(error):
                await cluster.submit(spec, "alice")

        assert cluster.jobs.list() == []
        assert cluster.state.load_jobs() == []
    finally:
        await cluster.close()


def test_a_corrupt_archive_inside_the_roots_is_invalid(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    root = cfg.dataset_roots()[0]
    good = root / "d.npz"
    np.savez_compressed(good, x=np.zeros((20, 4), np.float32), y=np.arange(20, dtype=np.int64) % 2)
    raw = bytearray(good.read_bytes())
    # An unknown compression method (99) in every local and central header.
    for sig, offset in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):
        at = raw.find(sig)
        while at >= 0:
            raw[at + offset : at + offset + 2] = (99).to_bytes(2, "little")
            at = raw.find(sig, at + 4)
    (root / "bad.npz").write_bytes(bytes(raw))
    (root / "junk.npz").write_bytes(b"PK\x03\x04" + os.urandom(64))

    for name in ("bad.npz", "junk.npz"):
        with pytest.raises(ConfigError, match=f"^data.path: {name}"):
            admit(_train(data={"path": name}), cfg)


def test_a_compressed_archive_counts_its_arrays_not_its_file(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, max_dataset_bytes=64 * 1024)
    root = cfg.dataset_roots()[0]
    x = np.zeros((1000, 64), np.float32)  # 256,000 bytes of zeros: a tiny compressed file
    np.savez_compressed(root / "zeros.npz", x=x, y=np.zeros(1000, np.int64))
    assert (root / "zeros.npz").stat().st_size < 64 * 1024

    with pytest.raises(LimitExceeded, match=r"^data.path: 264000 bytes exceeds"):
        admit(_train(data={"path": "zeros.npz"}), cfg)


def test_activation_checkpointing_needs_a_model_with_blocks(tmp_path: Path) -> None:
    from tests.fixtures import ALLOWED_MODELS

    cfg = _cfg(tmp_path, allowed_models=ALLOWED_MODELS)
    for entry in ("block_mlp", "small_mlp"):  # a blocks attribute; an nn.Sequential
        admit(_train(activation_checkpointing=True, model={"entry": entry}), cfg)
    with pytest.raises(
        ConfigError, match=r"^activation_checkpointing: model: _FlatLinear exposes no blocks"
    ):
        admit(_train(activation_checkpointing=True, model={"entry": "flat_linear"}), cfg)
    admit(_train(model={"entry": "flat_linear"}), cfg)  # without it: no blocks needed
