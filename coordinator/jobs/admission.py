"""Admission of a job spec: everything checked before a job is queued.

See docs/architecture.md, "Trust boundaries".

In order: the spec's size (``max_spec_bytes``), its schema, its entry points (listed in
``allowed_models``, args bound to the factory's signature, nothing called), its file paths
(confined to ``data_roots``), then estimates of what running it would cost, against the caps:
the data set's bytes (``max_dataset_bytes``) and what generating a synthetic one takes
(``max_synthetic_bytes``), the model's parameters (``max_model_params``) and one
micro-batch's activations (``max_activation_bytes``), both from a model built and run on
torch's ``meta`` device, which allocates no storage, the training steps or memory iterations
(``max_steps``), the memories (``max_memories_per_job``; a prioritized train job's priority
table holds one per training row) and one access batch
(``max_access_batch_bytes``). Nothing is imported, opened or allocated for a spec that an
earlier check refused.
"""

from __future__ import annotations

import math
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shared.config import (
    ACCESS_BYTES,
    BuiltinData,
    ConfigError,
    CoordinatorConfig,
    FileData,
    JobSpec,
    MemoryJobSpec,
    TraceAccess,
    TrainJobSpec,
    ZipfAccess,
    job_spec_from_json,
)
from shared.npz import UNREADABLE, NpyHeaderError, npz_members, read_npy_header
from shared.security.confinement import resolve_data_paths
from shared.training.activation_checkpointing import model_blocks
from shared.training.data import synthetic_peak_bytes, worker_steps
from shared.training.data_files import data_files, open_arrays
from shared.training.entry_points import EntryPointError, check_entries
from shared.training.file_sets import check_file_layout, check_values
from shared.training.models import ModelError, activation_bytes, build_model, count_params
from shared.training.partition import allreduce_steps_per_epoch, global_batch_size
from shared.training.tasks import DataError, task_of

DIGITS_SAMPLES, DIGITS_SHAPE, DIGITS_CLASSES = 1797, (1, 8, 8), 10


class LimitExceeded(Exception):
    """A spec asks for more than an admission cap allows (RESOURCE_EXHAUSTED).

    The message names the spec key, the value and the cap.
    """


@dataclass(frozen=True)
class DataShape:
    """What admission needs to know of a training set.

    Attributes:
        samples: N.
        input_shape: one sample's input shape (language_model: ``(T',)``).
        num_classes: the model's output width (classes, regression targets, vocabulary).
        target_shape: one sample's target shape (``()`` labels, ``(D,)``, ``(T',)``).
        input_dtype: of the model's input (float32, or int64 tokens).
    """

    samples: int
    input_shape: tuple[int, ...]
    num_classes: int
    target_shape: tuple[int, ...] = ()
    input_dtype: str = "float32"


def _cap(key: str, value: int, cap: int, cap_name: str, unit: str = "", what: str = "") -> None:
    """Refuse ``value`` over ``cap``: ``KEY: VALUE UNIT WHAT exceeds ... CAP_NAME CAP UNIT``.

    Raises:
        LimitExceeded: value > cap (RESOURCE_EXHAUSTED).
    """
    if value > cap:
        raise LimitExceeded(
            f"{key}: {value}{unit}{what} exceeds the coordinator's {cap_name} {cap}{unit}"
        )


def admit(spec_json: str, cfg: CoordinatorConfig) -> JobSpec:
    """Parse a submitted spec and check it against the coordinator's policy and caps.

    Args:
        spec_json: the spec as the SubmitJob RPC carries it (UTF-8 JSON).
        cfg: the coordinator's config (caps, ``allowed_models``, ``data_roots``).

    Returns:
        The validated spec, unchanged (paths are resolved again when the job runs).

    Raises:
        LimitExceeded: over a cap (RESOURCE_EXHAUSTED).
        ConfigError: invalid spec, a missing or malformed file inside the roots, a model
            that cannot be built for the data, or an entry's args that do not fit its
            signature (INVALID_ARGUMENT).
        PathRefused: a path outside the data roots (INVALID_ARGUMENT).
        EntryPointRefused: an entry not in ``allowed_models``, or not a public function or
            class defined in its listed module (PERMISSION_DENIED).
    """
    _cap(
        "spec",
        len(spec_json.encode("utf-8", "surrogatepass")),
        cfg.max_spec_bytes,
        "max_spec_bytes",
        " bytes",
    )
    spec = job_spec_from_json(spec_json)
    try:
        tables = {"allowed_models": cfg.allowed_models, "allowed_losses": cfg.allowed_losses}
        check_entries(spec, tables, "coordinator")
    except EntryPointError as exc:
        raise ConfigError(str(exc)) from None
    paths = resolve_data_paths(spec, cfg.dataset_roots())
    for key, path in paths.items():
        _cap(key, _data_bytes(key, path), cfg.max_dataset_bytes, "max_dataset_bytes", " bytes")
    if isinstance(spec, TrainJobSpec):
        _admit_train(spec, paths.get("data.path"), cfg)
    else:
        _admit_memory(spec, paths.get("load"), paths.get("access.trace"), cfg)
    return spec


def _file_size(key: str, path: Path) -> int:
    """Size of a file inside the roots, bytes. Raises: ConfigError when it is missing."""
    if not path.is_file():
        raise ConfigError(f"{key}: no file {path.name!r} in the coordinator's data roots")
    return path.stat().st_size


def _data_bytes(key: str, path: Path) -> int:
    """Bytes a file holds once loaded.

    The file's size, or for an ``.npz`` (a zip archive, possibly compressed) the sum of its
    arrays' sizes from their headers, whichever is larger; a directory of ``.npy``
    (``data.path`` only): its array files' sizes.

    Raises:
        ConfigError: missing file, or an archive whose headers cannot be read.
    """
    if path.is_dir() and key == "data.path":
        return sum(f.stat().st_size for f in data_files(path))
    size = _file_size(key, path)
    if not zipfile.is_zipfile(path):
        return size
    arrays = npz_headers(key, path).values()
    return max(size, sum(math.prod(shape) * dtype.itemsize for shape, dtype in arrays))


def meta_model(
    spec: TrainJobSpec, path: Path | None, cfg: CoordinatorConfig
) -> tuple[torch.nn.Module, DataShape]:
    """The spec's model on the meta device (shapes only, no storage) and its data's shape.

    Args:
        spec: the train job spec.
        path: its data file, already confined to the data roots (None: built-in data).
        cfg: the coordinator's limits and ``allowed_models``.

    Raises:
        ConfigError: the data set's header or the model cannot be read or built
            (INVALID_ARGUMENT).
    """
    shape = data_shape(
        spec.data,
        path,
        cfg.max_dataset_bytes,
        cfg.max_synthetic_bytes,
        spec.task,
        spec.vocab_size,
        cfg.max_compressed_array_bytes,
    )
    try:
        model = build_model(
            spec.model,
            shape.input_shape,
            shape.num_classes,
            spec.seed,
            cfg.allowed_models,
            "coordinator",
            device="meta",
        )
    except ModelError as exc:
        raise ConfigError(str(exc)) from None
    return model, shape


def _admit_train(spec: TrainJobSpec, path: Path | None, cfg: CoordinatorConfig) -> None:
    model, shape = meta_model(spec, path, cfg)
    if spec.activation_checkpointing:
        try:
            model_blocks(model)
        except ModelError as exc:
            raise ConfigError(f"activation_checkpointing: {exc}") from None
    _cap("model", count_params(model), cfg.max_model_params, "max_model_params", " parameters")
    _check_output_shape(spec, model, shape, cfg)
    dtype = torch.int64 if shape.input_dtype == "int64" else torch.float32
    activations = activation_bytes(model, shape.input_shape, spec.batch_size, dtype)
    if activations is not None:
        _cap(
            "batch_size",
            activations,
            cfg.max_activation_bytes,
            "max_activation_bytes",
            " bytes",
            f" of activations for {spec.batch_size} rows",
        )
    n_train = shape.samples - math.ceil(shape.samples * spec.test_fraction)
    steps = worker_steps(spec, max(n_train, 1))
    key = "steps" if spec.steps is not None else "epochs"
    _cap(key, steps, cfg.max_steps, "max_steps", " steps")
    if spec.sampling.name == "prioritized":  # one memory per training row
        _cap(
            "sampling.name",
            n_train,
            cfg.max_memories_per_job,
            "max_memories_per_job",
            " memories",
            " (prioritized: one per training row)",
        )
    if spec.sampling.name == "prioritized" and spec.strategy == "allreduce":
        _check_window_bytes(spec, max(n_train, 1), len(spec_json_of(spec)), cfg)


# What a generation's header holds besides its spec and window, bytes (a generous bound).
HEADER_SLACK_BYTES = 64 * 1024


def spec_json_of(spec: TrainJobSpec) -> str:
    """The spec as a generation's header carries it (``AllreduceJob._spec_json``)."""
    return spec.model_dump_json(by_alias=True)


def _check_window_bytes(
    spec: TrainJobSpec, n_train: int, spec_bytes: int, cfg: CoordinatorConfig
) -> None:
    """Refuse a prioritized allreduce job whose window cannot travel in one header.

    A window's rows (int64) and weights (float32), 12 bytes a row, go to every rank in the
    generation's header, one gRPC message (``max_message_bytes``).

    Raises:
        LimitExceeded: the largest window's header would pass max_message_bytes
            (RESOURCE_EXHAUSTED).
    """
    g = global_batch_size(spec)
    per_epoch = allreduce_steps_per_epoch(n_train, g)
    every = spec.sampling.resample_every_steps or per_epoch
    rows = min(every, per_epoch) * g if every < per_epoch else n_train
    size = 12 * rows + spec_bytes + HEADER_SLACK_BYTES
    if size > cfg.max_message_bytes:
        raise LimitExceeded(
            f"sampling.resample_every_steps: a window of {min(every, per_epoch)} steps draws "
            f"{rows} rows, {size} bytes with their weights in a generation's header, which "
            f"exceeds the coordinator's max_message_bytes {cfg.max_message_bytes} (set "
            "resample_every_steps lower)"
        )


def _check_output_shape(
    spec: TrainJobSpec, model: torch.nn.Module, shape: DataShape, cfg: CoordinatorConfig
) -> None:
    """Refuse a model whose output does not fit the task's targets (a meta-device forward).

    A forward that fails on the meta device (an op without a meta kernel) is not judged here:
    the job would fail at its first step instead.

    Raises:
        ConfigError: naming the model's output shape and the targets' (INVALID_ARGUMENT).
    """
    if spec.task == "classification" or not isinstance(spec.loss, str):
        return  # the width is the classes; a user loss judges its own shapes
    rows = 2
    dtype = torch.int64 if shape.input_dtype == "int64" else torch.float32
    x = torch.zeros((rows, *shape.input_shape), dtype=dtype, device="meta")
    targets_dtype = torch.int64 if spec.task == "language_model" else torch.float32
    y = torch.zeros((rows, *shape.target_shape), dtype=targets_dtype, device="meta")
    try:
        out = model(x)
    except Exception:  # noqa: BLE001 (the model's own code; judged at the first step)
        return
    if not isinstance(out, torch.Tensor):
        raise ConfigError(f"model: returns {type(out).__name__}, not a tensor")
    try:
        task_of(spec).per_sample_loss(out, y)
    except ValueError as exc:
        raise ConfigError(f"model: {exc}") from None
    except RuntimeError:
        return


def data_shape(
    data: BuiltinData | FileData,
    path: Path | None,
    max_bytes: int,
    max_synthetic_bytes: int | None = None,
    task: str = "classification",
    vocab_size: int | None = None,
    max_compressed: int | None = None,
) -> DataShape:
    """Samples, sample shape and output width of a job's data set, checked for its task.

    The headers are checked against the task's layout, then the targets' values (for
    language_model the tokens) are read and checked (``shared.training.tasks``), so a set
    the task's loss cannot take is refused before the job is queued, its first bad row named.

    Args:
        data: the spec's ``data``.
        path: the confined path of a file data set; None for a built-in one.
        max_bytes: ``max_dataset_bytes``: a synthetic set's x as float32 must fit.
        max_synthetic_bytes: ``max_synthetic_bytes``: what generating a synthetic set
            takes (``synthetic_peak_bytes``) must fit; None: not checked.
        task: the job's ``task``.
        vocab_size: the job's ``vocab_size`` (language_model), or None.
        max_compressed: ``max_compressed_array_bytes`` (None: no cap).

    Raises:
        LimitExceeded: a synthetic set over either cap (RESOURCE_EXHAUSTED); the message
            names the key and its samples, features and classes.
        ConfigError: a file whose arrays are missing or malformed (names the array).
    """
    if isinstance(data, BuiltinData):
        if data.name == "digits":
            return DataShape(DIGITS_SAMPLES, DIGITS_SHAPE, DIGITS_CLASSES)
        _cap(
            "data.samples",
            data.samples * data.features * 4,
            max_bytes,
            "max_dataset_bytes",
            " bytes",
        )
        if max_synthetic_bytes is not None:
            _cap(
                "data",
                synthetic_peak_bytes(data.samples, data.features, data.classes),
                max_synthetic_bytes,
                "max_synthetic_bytes",
                " bytes",
                f" to generate (samples {data.samples}, features {data.features}, "
                f"classes {data.classes})",
            )
        return DataShape(data.samples, (data.features,), data.classes)
    assert path is not None
    return _file_shape(path, task, vocab_size, max_compressed)


def _file_shape(
    path: Path, task: str, vocab_size: int | None, max_compressed: int | None
) -> DataShape:
    """``data_shape`` of a file data set (``.npz`` or a directory of ``.npy``).

    The headers, then the targets' values (and a language model's tokens) block by block
    (``shared.training.file_sets``); nothing is read whole.

    Raises:
        ConfigError: ``data.path: FILE: ...`` naming the array (and its first bad row), its
            dtype when no task takes it, or a compressed array over ``max_compressed``.
    """
    try:
        arrays = open_arrays(path, max_compressed)
        check_file_layout(arrays, task)
        width = check_values(arrays, task, vocab_size, targets_only=True)
    except DataError as exc:
        raise ConfigError(f"data.path: {path.name}: {exc}") from None
    x, y = arrays["x"], arrays.get("y")
    n = len(x)
    if "x_test" in arrays:
        n += len(arrays["x_test"])  # admission's n_train: N - ceil(N * test_fraction) rows
    x_shape = x.shape[1:]
    if task == "language_model":
        t = x_shape[0] - (1 if y is None else 0)
        return DataShape(n, (t,), width, (t,), "int64")
    assert y is not None
    return DataShape(n, x_shape, width, y.shape[1:])


def npz_headers(key: str, path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shape and dtype of every ``.npy`` member of an ``.npz``, read from the headers only.

    Raises:
        ConfigError: not a zip of ``.npy`` arrays, or a header that cannot be read.
    """
    out: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    try:
        with zipfile.ZipFile(path) as zf:
            for member in npz_members(zf):
                out[member.name] = (member.shape, member.dtype)
    except UNREADABLE as exc:
        raise ConfigError(f"{key}: {path.name} is not a readable .npz ({exc})") from None
    return out


def _admit_memory(
    spec: MemoryJobSpec, load: Path | None, trace: Path | None, cfg: CoordinatorConfig
) -> None:
    if spec.topk > cfg.topk_max:
        raise ConfigError(f"topk: {spec.topk} exceeds the coordinator's topk_max {cfg.topk_max}")
    _cap("iterations", spec.iterations, cfg.max_steps, "max_steps")
    batch = spec.access.batch if isinstance(spec.access, ZipfAccess) else None
    if isinstance(spec.access, TraceAccess) and trace is not None:
        batch = _trace_batch(trace)
    if batch is not None:
        key = "access.batch" if isinstance(spec.access, ZipfAccess) else "access.trace"
        _cap(
            key,
            batch * ACCESS_BYTES,
            cfg.max_access_batch_bytes,
            "max_access_batch_bytes",
            " bytes",
            f" for {batch} accesses",
        )
    if load is None:
        _cap("memories", spec.memories, cfg.max_memories_per_job, "max_memories_per_job")
        return
    ids = npz_headers("load", load).get("ids")
    if ids is not None:  # a missing array is reported, naming it, when the job loads the file
        count = math.prod(ids[0])
        _cap("load", count, cfg.max_memories_per_job, "max_memories_per_job", " memories")


def _trace_batch(path: Path) -> int | None:
    """B, the accesses per iteration of an ``.npy`` trace ([I, B] or [B]), from its header.

    None when the header cannot be read: the job then fails naming the file when it loads it.
    """
    try:
        with path.open("rb") as f:
            shape = read_npy_header(f).shape
    except (OSError, NpyHeaderError):
        return None
    return int(shape[-1]) if shape else None
