"""From YAML and JSON to validated models: daemon configs and job specs.

A daemon config takes the CLI's flags over its file; a job spec's ``kind`` picks its model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from shared.config.fields import ConfigError, format_validation_error
from shared.config.memory_spec import MemoryJobSpec
from shared.config.train_spec import TrainJobSpec

T = TypeVar("T", bound=BaseModel)

JobSpec = TrainJobSpec | MemoryJobSpec


def parse_job_spec(data: object) -> JobSpec:
    """Validate a job spec given as a dict (from YAML or JSON); its ``kind`` picks the model.

    Raises:
        ConfigError: unknown key, wrong type, out-of-range value; the message names the field
            (the coordinator maps it to INVALID_ARGUMENT).
    """
    if not isinstance(data, dict):
        raise ConfigError(f"job spec: expected a mapping, got {type(data).__name__}")
    kind = data.get("kind")
    model: type[TrainJobSpec] | type[MemoryJobSpec]
    if kind == "train":
        model = TrainJobSpec
    elif kind == "memory":
        model = MemoryJobSpec
    else:
        raise ConfigError(f"kind: expected 'train' or 'memory', got {kind!r}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def job_spec_from_json(text: str) -> JobSpec:
    """Parse and validate a job spec sent as JSON (the SubmitJob RPC).

    Raises:
        ConfigError: invalid JSON or an invalid spec (INVALID_ARGUMENT).
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"spec_json: not valid JSON ({exc.msg} at char {exc.pos})") from None
    except RecursionError:
        raise ConfigError("spec_json: nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more digits than int() converts
        raise ConfigError(f"spec_json: {str(exc)[:200]}") from None
    return parse_job_spec(data)


def load_yaml(path: str | Path) -> Any:
    """Read a YAML file with ``yaml.safe_load`` (no Python objects are constructed).

    Returns:
        What the file holds; ``{}`` for an empty file.

    Raises:
        ConfigError: the file is missing or is not valid YAML.
    """
    p = Path(path)
    try:
        return yaml.safe_load(p.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: invalid YAML: {exc}") from None


def load_config(model: type[T], path: str | Path | None, **overrides: Any) -> T:
    """Load a daemon config from YAML (or defaults), apply non-None overrides, validate.

    Args:
        model: the config class, ``CoordinatorConfig`` or ``WorkerConfig``.
        path: a YAML file of settings; None: defaults only.
        **overrides: settings that win over the file (the CLI's flags); None values are
            ignored.

    Raises:
        ConfigError: the message names the file and field; also a file that is missing, not
            YAML, or not a mapping of settings.
    """
    loaded = load_yaml(path) if path else {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(loaded).__name__}")
    data = dict(loaded)
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, f"{path}: " if path else "")) from None
