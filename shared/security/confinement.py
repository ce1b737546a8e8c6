"""What a job spec may make a daemon read: files in the data roots.

The trust boundary (docs/architecture.md, "Trust boundaries"): clients never cause code to
run or files to be read that the operator did not allow.

A spec field that names a file is marked in ``shared.config`` with
``json_schema_extra=DATA_PATH_REF``; :func:`spec_refs` finds every marked field of a spec, so a
field added later is checked without anyone remembering to. The coordinator checks them all
before a job is queued. Code is named only by entry points the operator listed
(``shared.training.entry_points``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import TypeVar

from pydantic import BaseModel

from shared.config import DATA_PATH_REF, TRUST_KEY

SpecT = TypeVar("SpecT", bound=BaseModel)


class PathRefused(ValueError):
    """A spec path lies outside the data roots (INVALID_ARGUMENT).

    It is absolute outside every root, contains ``..``, or leads out of its root through a
    symlink. The message is the same whether or not the file exists, so a refusal reveals
    nothing about the coordinator's file system.
    """


def spec_refs(spec: BaseModel, prefix: str = "") -> Iterator[tuple[str, str, str]]:
    """List every import or data path a spec names, through nested models.

    Args:
        spec: a validated job spec (or any part of one).
        prefix: prepended to every key (used by the recursion).

    Yields:
        ``(key, kind, value)``: the dotted spec key (``model.entry``, ``data.path``,
        ``access.trace``), ``"entry"`` or ``"data_path"``, and the value as a string.
        Unset (None) fields are skipped.
    """
    for name, field in type(spec).model_fields.items():
        value = getattr(spec, name)
        key = f"{prefix}{field.alias or name}"
        extra = field.json_schema_extra
        kind = extra.get(TRUST_KEY) if isinstance(extra, dict) else None
        if kind is not None and value is not None:
            yield key, str(kind), str(value)
        elif isinstance(value, BaseModel):
            yield from spec_refs(value, key + ".")


def _inside(path: Path, root: Path) -> bool:
    """Whether ``path`` is ``root`` or below it, lexically."""
    return path == root or root in path.parents


def resolve_data_path(key: str, value: str, roots: Sequence[Path]) -> Path:
    """The file a spec path names, confined to the data roots.

    A relative path is looked up in each root in order (the first root holding it wins; the
    first root when none does); an absolute one must lie inside a root. Symlinks are
    followed and the real path must still lie inside the same root. The checks are lexical
    and on the real path, so a refusal says nothing about whether the file exists.

    Args:
        key: the spec key, for the message (``data.path``).
        value: the path as the spec gives it.
        roots: absolute data roots (``CoordinatorConfig.dataset_roots()``).

    Returns:
        The real (symlink-free) absolute path, which may not exist.

    Raises:
        PathRefused: empty, NUL byte, ``..`` component, absolute outside every root, or a
            symlink leaving the root (INVALID_ARGUMENT).
    """
    outside = PathRefused(f"{key}: {value!r} is outside the coordinator's data roots")
    if not value or "\x00" in value:
        raise PathRefused(f"{key}: must be a non-empty path without NUL bytes")
    if ".." in PurePosixPath(value).parts or ".." in Path(value).parts:
        raise PathRefused(f"{key}: {value!r} must not contain '..'")
    path = Path(value)
    candidates: list[tuple[Path, Path]] = []
    for root in roots:
        if path.is_absolute():
            if _inside(path, root):
                candidates.append((root, path))
        else:
            candidates.append((root, root / path))
    if not candidates:
        raise outside
    chosen: tuple[Path, Path] | None = None
    for root, candidate in candidates:
        real_root = Path(os.path.realpath(root))
        real = Path(os.path.realpath(candidate))
        if not _inside(real, real_root):
            raise outside
        if chosen is None or (not chosen[1].exists() and real.exists()):
            chosen = (real_root, real)
    assert chosen is not None
    return chosen[1]


def resolve_data_paths(spec: BaseModel, roots: Sequence[Path]) -> dict[str, Path]:
    """Run :func:`resolve_data_path` on every data path a spec names.

    Args:
        spec: a validated job spec.
        roots: absolute data roots.

    Returns:
        ``{spec key: real path}``.

    Raises:
        PathRefused: the first path refused (INVALID_ARGUMENT).
    """
    return {
        key: resolve_data_path(key, value, roots)
        for key, kind, value in spec_refs(spec)
        if kind == DATA_PATH_REF[TRUST_KEY]
    }


def with_resolved_paths(spec: SpecT, roots: Sequence[Path]) -> SpecT:
    """Return a copy of ``spec`` whose data paths are replaced by their confined real paths.

    The coordinator calls it again when a job starts, not only at admission: a symlink in a
    root may have changed since, or the job was resumed after a restart.

    Args:
        spec: a validated job spec.
        roots: absolute data roots.

    Raises:
        PathRefused: a path is refused (INVALID_ARGUMENT).
    """
    resolved = resolve_data_paths(spec, roots)
    data = spec.model_dump(by_alias=True)
    for key, path in resolved.items():
        node = data
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        node[leaf] = str(path)
    return type(spec).model_validate(data)
