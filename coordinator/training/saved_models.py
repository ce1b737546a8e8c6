"""Train jobs' saved models on the coordinator's disk: where, which, streamed out, loaded back.

A train job writes ``DATA_DIR/models/JOB.pt`` when it finishes
(``coordinator.training.checkpoints.save_model``, a ``torch.save`` of the state dict) and
``JOB.best.pt``, its best epoch's state dict, at its checkpoints and when it ends
(``coordinator.training.best_model``). Clients name a model by job id only (``GetModel``,
``ListModels``); the id is looked up in the job store before a path is built from it, so no
client string becomes a path. A job may start from one of them (``init: {job: ID}``) or from
a state dict uploaded as a data set (``init: {dataset: NAME}``, ``NAME.pt`` in the data
roots, confined there like any data path): the file is size-checked against
``max_dataset_bytes`` before it is read, loaded with ``torch.load(weights_only=True)`` and
checked tensor by tensor against the spec's model (built on the meta device) before the job
is queued.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from coordinator.datasets.state_dicts import WEIGHTS_SUFFIX, StateDictError, read_state_dict
from coordinator.jobs.admission import meta_model
from coordinator.jobs.jobs import JobRecord
from shared.config import ConfigError, CoordinatorConfig, InitSpec, TrainJobSpec
from shared.security.confinement import resolve_data_path, resolve_data_paths


class ModelMissing(Exception):
    """The job has no saved model of that kind (yet) (NOT_FOUND)."""


def model_file(data_dir: str | Path, job_id: str, best: bool = False) -> Path:
    """Where a job's final (or best) model is saved; ``job_id`` must come from the job store."""
    return Path(data_dir) / "models" / f"{job_id}{'.best' if best else ''}.pt"


@dataclass(frozen=True)
class SavedModel:
    """A job with at least one saved model, as ``ListModels`` reports it.

    Attributes:
        job: the job.
        bytes: size of the final model's file, bytes (0: none).
        best_bytes: size of the best model's file, bytes (0: none).
        saved_at: Unix seconds the newer of the two files was written.
        best_test_accuracy: the job's best test accuracy; NaN when unknown.
    """

    job: JobRecord
    bytes: int
    best_bytes: int
    saved_at: float
    best_test_accuracy: float


def saved_model(job: JobRecord, data_dir: str | Path) -> SavedModel | None:
    """The saved models of ``job``, or None when it has none (not a train job, or none yet)."""
    if job.kind != "train":
        return None
    sizes, times = [], []
    for best in (False, True):
        try:
            st = model_file(data_dir, job.job_id, best).stat()
        except FileNotFoundError:
            sizes.append(0)
            continue
        sizes.append(st.st_size)
        times.append(st.st_mtime)
    if not times:
        return None
    acc = (job.result or {}).get("best_test_accuracy")
    if acc is None:
        acc = (job.progress or {}).get("best_test_accuracy")
    best_acc = float(acc) if isinstance(acc, int | float) and math.isfinite(acc) else math.nan
    return SavedModel(job, sizes[0], sizes[1], max(times), best_acc)


def model_chunks(path: Path, chunk_bytes: int) -> tuple[int, str, Generator[bytes]]:
    """Open a saved model for streaming: its size, SHA-256 and its bytes in pieces.

    The file is read once for the digest, then again piece by piece (blocking reads: call
    both in a thread).

    Args:
        path: a path from ``model_file``.
        chunk_bytes: the size of each piece, bytes (>= 1).

    Raises:
        ModelMissing: no such file (NOT_FOUND).
    """
    sha = hashlib.sha256()
    try:
        with path.open("rb") as f:
            size = 0
            while piece := f.read(chunk_bytes):
                sha.update(piece)
                size += len(piece)
    except FileNotFoundError:
        raise ModelMissing("no such saved model") from None

    def pieces() -> Generator[bytes]:
        with path.open("rb") as f:
            while piece := f.read(chunk_bytes):
                yield piece

    return size, sha.hexdigest(), pieces()


def load_state_dict(path: Path, label: str, max_bytes: int) -> dict[str, torch.Tensor]:
    """Read a ``torch.save``'d state dict with ``weights_only=True``, onto the CPU.

    Args:
        path: the file (``model_file``, or an uploaded ``NAME.pt``).
        label: how messages name it (``init.job``), never the coordinator's path.
        max_bytes: ``max_dataset_bytes``: a larger file is refused before it is read.

    Raises:
        ConfigError: missing, over ``max_bytes``, unreadable, or not a mapping of names to
            tensors (INVALID_ARGUMENT).
    """
    try:
        return read_state_dict(path, label, max_bytes)
    except FileNotFoundError:
        raise ConfigError(f"{label}: that job has no saved model") from None
    except StateDictError as exc:
        raise ConfigError(str(exc)) from None


def check_state_dict(model: nn.Module, state: dict[str, torch.Tensor], label: str) -> None:
    """Refuse a state dict that does not fit ``model`` tensor for tensor, naming the first misfit.

    The model's tensors are checked in ``state_dict()`` order (a missing one or a shape that
    differs), then the state dict's extra names.

    Args:
        model: the job's model (on the meta device is enough: only shapes are read).
        state: name -> tensor.
        label: the spec key in messages (``init.job``).

    Raises:
        ConfigError: ``LABEL: tensor NAME: expected shape [..], found [..]``, a missing or an
            unexpected tensor (INVALID_ARGUMENT).
    """
    expected = model.state_dict()
    for name, want in expected.items():
        got = state.get(name)
        if got is None:
            raise ConfigError(
                f"{label}: tensor {name!r} (shape {list(want.shape)}) is missing from the "
                "saved model"
            )
        if tuple(got.shape) != tuple(want.shape):
            raise ConfigError(
                f"{label}: tensor {name!r}: expected shape {list(want.shape)}, "
                f"found {list(got.shape)}"
            )
    for name, got in state.items():
        if name not in expected:
            raise ConfigError(
                f"{label}: unexpected tensor {name!r} (shape {list(got.shape)}) in the saved model"
            )


def spec_model(spec: TrainJobSpec, cfg: CoordinatorConfig) -> nn.Module:
    """The spec's model on the meta device (shapes only), as admission builds it.

    ``coordinator.jobs.admission.meta_model`` on the spec's confined data path.

    Raises:
        ConfigError: the data set's header or the model cannot be read or built
            (INVALID_ARGUMENT).
        PathRefused: the data path is outside the data roots (INVALID_ARGUMENT).
    """
    path = resolve_data_paths(spec, cfg.dataset_roots()).get("data.path")
    return meta_model(spec, path, cfg)[0]


def init_source(init: InitSpec, cfg: CoordinatorConfig) -> tuple[Path, str]:
    """The file an ``init`` names, and its spec key for messages (``init.job``, ``init.dataset``).

    A job's id must have been checked against the job store (``Cluster.submit``) or come
    from an admitted spec; a data set's name is confined to the data roots.

    Raises:
        PathRefused: the data set's name resolves outside the data roots (INVALID_ARGUMENT).
    """
    if init.job is not None:
        return model_file(cfg.data_dir, init.job, init.best), "init.job"
    assert init.dataset is not None
    name = init.dataset.removesuffix(WEIGHTS_SUFFIX) + WEIGHTS_SUFFIX
    return resolve_data_path("init.dataset", name, cfg.dataset_roots()), "init.dataset"


def _read_init(init: InitSpec, cfg: CoordinatorConfig) -> tuple[dict[str, torch.Tensor], str]:
    """Read the state dict ``init`` names. Raises: ConfigError, PathRefused."""
    path, label = init_source(init, cfg)
    if init.dataset is not None and not path.is_file():
        raise ConfigError(
            f"{label}: no {path.name} in the coordinator's data roots "
            "(neuroshard data put W.pt --name NAME)"
        )
    return load_state_dict(path, label, cfg.max_dataset_bytes), label


def check_init(spec: TrainJobSpec, cfg: CoordinatorConfig) -> None:
    """Check before queueing that the spec's ``init`` model fits the spec's model.

    Blocking (reads the file, builds the model on the meta device): call it in a thread.

    Raises:
        ConfigError: see ``load_state_dict`` and ``check_state_dict`` (INVALID_ARGUMENT).
        PathRefused: a data set name outside the data roots (INVALID_ARGUMENT).
    """
    assert spec.init is not None
    state, label = _read_init(spec.init, cfg)
    check_state_dict(spec_model(spec, cfg), state, label)


def initial_state(spec: TrainJobSpec, model: nn.Module, cfg: CoordinatorConfig) -> None:
    """Load a job's ``init`` model into ``model`` in place (nothing without ``init``).

    Checked again: the file may have changed since admission.

    Args:
        spec: the job.
        model: the job's freshly built model, on the CPU.
        cfg: the coordinator's config (``data_dir``, ``data_roots``, ``max_dataset_bytes``).

    Raises:
        ConfigError: the saved model is gone, too large, or no longer fits.
        PathRefused: a data set name now outside the data roots.
    """
    if spec.init is None:
        return
    state, label = _read_init(spec.init, cfg)
    check_state_dict(model, state, label)
    with torch.no_grad():
        model.load_state_dict(state)
