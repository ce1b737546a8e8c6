"""The demo's default job is found in a checkout and in the container image."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.cli import common
from shared.cli.common import EXIT_USAGE, CliError, example_job


def test_a_checkout_takes_its_own_configs() -> None:
    assert Path(example_job("digits-mlp.yaml")) == common.REPO_ROOT / "configs/jobs/digits-mlp.yaml"


def test_an_installed_package_takes_the_image_configs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Arrange: no checkout around the package; the image's /etc/neuroshard holds configs/.
    (tmp_path / "etc/jobs").mkdir(parents=True)
    (tmp_path / "etc/jobs/digits-mlp.yaml").write_text("kind: train\n")
    monkeypatch.setattr(common, "REPO_ROOT", tmp_path / "site-packages")
    monkeypatch.setattr(common, "IMAGE_CONFIG_DIR", tmp_path / "etc")

    # Act / assert
    assert example_job("digits-mlp.yaml") == str(tmp_path / "etc/jobs/digits-mlp.yaml")


def test_neither_asks_for_a_job_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(common, "IMAGE_CONFIG_DIR", tmp_path)

    with pytest.raises(CliError, match="--job") as err:
        example_job("digits-mlp.yaml")
    assert err.value.code == EXIT_USAGE
