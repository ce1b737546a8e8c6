"""Saved models: the init checks (size before reading, weights_only, the first misfit tensor
named) and the streaming pieces, without a cluster. Messages are pinned literally."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from torch import nn

from coordinator.training.saved_models import (
    ModelMissing,
    check_state_dict,
    load_state_dict,
    model_chunks,
    model_file,
)
from shared.config import ConfigError


def model() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def test_a_fitting_state_dict_passes_and_a_misfit_names_the_first_tensor() -> None:
    good = model().state_dict()
    check_state_dict(model(), good, "init.job")

    wrong = dict(good) | {"3.weight": torch.zeros(2, 5)}
    with pytest.raises(ConfigError) as shape:
        check_state_dict(model(), wrong, "init.job")
    missing = {k: v for k, v in good.items() if k != "1.bias"}
    with pytest.raises(ConfigError) as gone:
        check_state_dict(model(), missing, "init.job")
    with pytest.raises(ConfigError) as extra:
        check_state_dict(model(), dict(good) | {"9.weight": torch.zeros(1)}, "init.job")

    assert str(shape.value) == "init.job: tensor '3.weight': expected shape [2, 3], found [2, 5]"
    assert str(gone.value) == (
        "init.job: tensor '1.bias' (shape [3]) is missing from the saved model"
    )
    assert str(extra.value) == (
        "init.job: unexpected tensor '9.weight' (shape [1]) in the saved model"
    )


def test_the_meta_model_is_enough_to_check_shapes() -> None:
    with torch.device("meta"):
        meta = model()
    check_state_dict(meta, model().state_dict(), "init.job")


def test_load_refuses_over_the_cap_before_reading_and_what_is_not_a_state_dict(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m.pt"
    torch.save(model().state_dict(), path)
    size = path.stat().st_size
    assert list(load_state_dict(path, "init.job", size)) == list(model().state_dict())

    with pytest.raises(ConfigError) as big:
        load_state_dict(path, "init.job", size - 1)
    torch.save({"w": [1, 2]}, path)
    with pytest.raises(ConfigError) as not_tensors:
        load_state_dict(path, "init.job", 1 << 20)
    path.write_bytes(b"junk")
    with pytest.raises(ConfigError) as junk:
        load_state_dict(path, "init.job", 1 << 20)
    with pytest.raises(ConfigError) as gone:
        load_state_dict(tmp_path / "none.pt", "init.job", 1 << 20)

    assert str(big.value) == (
        f"init.job: the saved model is {size} bytes, over the coordinator's "
        f"max_dataset_bytes {size - 1}"
    )
    assert str(not_tensors.value) == ("init.job: not a state dict (a mapping of names to tensors)")
    assert str(junk.value).startswith("init.job: not a readable state dict (")
    assert str(gone.value) == "init.job: that job has no saved model"


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("pickled code ran",))


def test_load_runs_no_pickled_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"w": _Evil()}, path)

    with pytest.raises(ConfigError):
        load_state_dict(path, "init.job", 1 << 20)

    assert "pickled code ran" not in capsys.readouterr().out


def test_chunks_cover_the_file_and_its_digest(tmp_path: Path) -> None:
    path = model_file(tmp_path, "train-1", best=True)
    assert path == tmp_path / "models" / "train-1.best.pt"
    path.parent.mkdir()
    data = bytes(range(256)) * 41
    path.write_bytes(data)

    size, sha, pieces = model_chunks(path, 1000)

    got = list(pieces)
    assert (size, sha) == (len(data), hashlib.sha256(data).hexdigest())
    assert b"".join(got) == data and [len(p) for p in got[:-1]] == [1000] * (len(got) - 1)
    with pytest.raises(ModelMissing):
        model_chunks(tmp_path / "none.pt", 1000)
