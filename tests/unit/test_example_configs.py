"""configs/coordinator.yaml and configs/worker.yaml say "Every key is optional; these are the
defaults": each lists every field of its daemon's config, with the default value."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shared.config import CoordinatorConfig, WorkerConfig, load_config, parse_job_spec

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize(
    ("file", "model"), [("coordinator.yaml", CoordinatorConfig), ("worker.yaml", WorkerConfig)]
)
def test_example_config_lists_every_key_with_its_default(file: str, model: type) -> None:
    listed = yaml.safe_load((CONFIGS / file).read_text())

    loaded = load_config(model, CONFIGS / file)

    assert sorted(listed) == sorted(model.model_fields)
    assert loaded == model()


@pytest.mark.parametrize("path", sorted((CONFIGS / "jobs").glob("*.yaml")), ids=lambda p: p.name)
def test_example_job_is_a_valid_spec(path: Path) -> None:
    spec = parse_job_spec(yaml.safe_load(path.read_text()))

    assert spec.name == path.stem
