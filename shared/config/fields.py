"""What every config model shares: base model, errors, field markers and validators.

``ConfigModel`` refuses unknown keys; the validators check entry points and HOST:PORT
addresses; ``format_validation_error`` turns pydantic's error into one line naming the field
(``ConfigError``), which the CLI prints and the coordinator returns as INVALID_ARGUMENT.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

# Markers of spec fields that name code or files: ``shared.security.confinement`` finds and
# checks every data path, ``shared.training.entry_points.check_entries`` every entry point (with
# the config table named by ENTRY_TABLE_KEY), so a new such field cannot be forgotten.
TRUST_KEY = "neuroshard_trust"
ENTRY_TABLE_KEY = "neuroshard_entry_table"
DATA_PATH_REF: dict[str, Any] = {TRUST_KEY: "data_path"}
MODEL_ENTRY_REF: dict[str, Any] = {TRUST_KEY: "entry", ENTRY_TABLE_KEY: "allowed_models"}
LOSS_ENTRY_REF: dict[str, Any] = {TRUST_KEY: "entry", ENTRY_TABLE_KEY: "allowed_losses"}

# An entry point as the operator lists it: ``package.module:function`` (one public attribute of
# a dotted module, no leading underscores), and an entry name as a spec gives it.
_TARGET_PART = r"[A-Za-z][A-Za-z0-9_]*"
ENTRY_TARGET_PATTERN = rf"^{_TARGET_PART}(\.{_TARGET_PART})*:{_TARGET_PART}$"
ENTRY_NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_]*$"


def check_entry_target(target: str) -> str:
    """Check an entry point's target ``package.module:function``; return it unchanged.

    Raises:
        ValueError: not a dotted module, a colon and ONE public attribute (no dots after
            the colon, no leading underscore anywhere, so no dunder).
    """
    if not re.fullmatch(ENTRY_TARGET_PATTERN, target):
        raise ValueError(
            "expected 'package.module:function' (one public function or class defined in the "
            f"module: no dots after ':', no leading underscores), got {target!r}"
        )
    return target


def check_entry_name(name: str) -> str:
    """Check an entry name (one identifier, no leading underscore); return it unchanged.

    Raises:
        ValueError: anything else, e.g. a dotted path or ``module:function``.
    """
    if not re.fullmatch(ENTRY_NAME_PATTERN, name):
        raise ValueError(
            f"expected the name of an entry point listed in allowed_models (letters, digits "
            f"and _, not a module path), got {name!r}"
        )
    return name


EntryName = Annotated[str, Field(max_length=128), AfterValidator(check_entry_name)]
EntryTarget = Annotated[str, Field(max_length=512), AfterValidator(check_entry_target)]


class ConfigError(ValueError):
    """A config file or job spec is invalid; the message names the field (INVALID_ARGUMENT)."""


class ConfigModel(BaseModel):
    """Base of every model: unknown keys are refused, assignments are validated too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def check_host_port(value: str) -> str:
    """Check ``HOST:PORT`` (port 0..65535); return it unchanged.

    Raises:
        ValueError: no host, no colon, or a port that is not a number in 0..65535.
    """
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT with a port in 0..65535, got {value!r}")
    return value


def removed_key(data: Any, key: str, why: str, allow_empty: bool = False) -> Any:
    """Refuse a key a config no longer has, saying why (a validator's ``mode="before"`` step).

    Args:
        data: the section's raw mapping (anything else passes through).
        key: the removed key.
        why: the message after ``key:``.
        allow_empty: drop the key silently when its value is empty (null, "").

    Raises:
        ValueError: ``key`` is present (pydantic names the section).
    """
    if not isinstance(data, dict) or key not in data:
        return data
    if allow_empty and not data[key]:
        return {k: v for k, v in data.items() if k != key}
    raise ValueError(f"{key}: {why}")


# The job specs' tagged-union fields (train_spec's model and data, memory_spec's access) and
# their tags, which pydantic puts in an error's location.
_UNION_FIELDS = {"model", "data", "access"}
_UNION_TAGS = {"mlp", "cnn", "entry", "digits", "synthetic", "path", "zipf", "trace"}


def format_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """The first error as ``dotted.key: message``, counting the others."""
    err = exc.errors()[0]
    parts: list[str] = []
    tag_dropped = False
    for p in err["loc"]:
        # Drop the one union tag pydantic inserts after a tagged-union field (model.mlp.hidden);
        # a field named like a tag after it stays (model.entry).
        if parts and parts[-1] in _UNION_FIELDS and p in _UNION_TAGS and not tag_dropped:
            tag_dropped = True
            continue
        if not str(p).startswith(("function-after", "tagged")):
            parts.append(str(p))
            tag_dropped = False
    loc = ".".join(parts)
    msg = err["msg"].removeprefix("Value error, ")
    # A model-level check has no field: "FILE: message" (its message names the fields).
    where = f"{prefix}{loc}" if loc else (prefix.removesuffix(": ").rstrip(".") or "spec")
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{where}: {msg}{more}"
