"""``BestModel``: the best epoch's model kept in memory, written when asked, once."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from coordinator.training.best_model import BestModel


def _model(value: float) -> nn.Module:
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _saved(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def test_nothing_is_written_before_a_best_is_kept(tmp_path: Path) -> None:
    best = BestModel(tmp_path / "models" / "job.best.pt")

    best.write()

    assert not best.pending
    assert not (tmp_path / "models").exists()


def test_the_file_holds_the_model_as_it_was_kept_not_as_it_is_when_written(
    tmp_path: Path,
) -> None:
    # Arrange: the best epoch's model, then training goes on changing it in place
    path = tmp_path / "models" / "job.best.pt"
    best, model = BestModel(path), _model(1.0)
    best.keep(model)
    with torch.no_grad():
        model[0].weight.fill_(5.0)

    # Act
    assert best.pending
    best.write()

    # Assert: the kept values, parameters and buffers, in a state dict torch.load reads
    saved = _saved(path)
    assert sorted(saved) == sorted(model.state_dict())
    assert torch.equal(saved["0.weight"], torch.ones(2, 2))
    assert torch.equal(saved["1.running_var"], torch.ones(2))
    assert not best.pending
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_write_with_nothing_new_leaves_the_file_alone(tmp_path: Path) -> None:
    # Arrange: a best written, then a later one kept and written
    path = tmp_path / "job.best.pt"
    best = BestModel(path)
    best.keep(_model(1.0))
    best.write()
    best.keep(_model(2.0))
    best.write()

    # Act: the job ends with no newer best (a resumed job's file is left as it is, too)
    best.write()
    BestModel(path).write()

    # Assert: the last kept model
    assert torch.equal(_saved(path)["0.weight"], torch.full((2, 2), 2.0))
    assert [p.name for p in tmp_path.iterdir()] == ["job.best.pt"]


def test_a_refused_write_at_a_jobs_end_is_not_raised_and_the_model_stays_kept(
    tmp_path: Path,
) -> None:
    # Arrange: the models directory's place is taken by a file
    (tmp_path / "models").write_bytes(b"")
    best = BestModel(tmp_path / "models" / "job.best.pt")
    best.keep(_model(1.0))

    # Act: a failed job's cleanup; its own error is what the record keeps
    best.write_at_end("job")

    # Assert
    assert best.pending
