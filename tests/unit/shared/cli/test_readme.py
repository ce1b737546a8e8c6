"""The README stays true: every config field, CLI command and make target it must name."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.cli.main import build_parser
from shared.config import CoordinatorConfig, MemoryJobSpec, TrainJobSpec, WorkerConfig

README = (Path(__file__).resolve().parents[4] / "README.md").read_text()


@pytest.mark.parametrize("model", [CoordinatorConfig, WorkerConfig, TrainJobSpec, MemoryJobSpec])
def test_every_config_field_is_documented(model) -> None:
    for name, field in model.model_fields.items():
        assert f"`{field.alias or name}`" in README, f"{model.__name__}.{name} missing"


def test_every_cli_command_is_documented() -> None:
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for command in commands:
        assert f"neuroshard {command}" in README, command


def test_readme_commands_are_the_makefile_targets() -> None:
    makefile = (Path(__file__).resolve().parents[4] / "Makefile").read_text()
    for target in (
        "demo",
        "test",
        "test-chaos",
        "lint",
        "bench-train",
        "bench-memory",
        "bench-recovery",
        "deploy-check",
        "image",
    ):
        assert f"\n{target}:" in makefile and f"make {target}" in README, target
