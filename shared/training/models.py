"""Model construction for training jobs: the built-in mlp and cnn, or an imported callable.

The built-ins hold no BatchNorm or Dropout: their forward pass depends only on the parameters
and the batch, so averaging per-shard gradients equals one gradient over the global batch.
Initialisation is seeded without touching the caller's global RNG state.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from shared.config import CnnSpec, ImportModelSpec, MlpSpec
from shared.security.confinement import check_import

# Input shapes the cnn accepts, with the number of 2x2 max-pools that suit each size.
_CNN_POOLS: dict[tuple[int, ...], int] = {(1, 8, 8): 1, (1, 28, 28): 2}


class ModelError(ValueError):
    """A model cannot be built for the job's data; the message says why (INVALID_ARGUMENT)."""


def build_model(
    spec: MlpSpec | CnnSpec | ImportModelSpec,
    input_shape: Sequence[int],
    num_classes: int,
    seed: int,
    allowed_imports: Sequence[str] = (),
    daemon: str = "coordinator",
    device: str | torch.device = "cpu",
) -> nn.Module:
    """Build a job's model with deterministic initial parameters.

    The same (spec, input_shape, num_classes, seed) gives the same parameters in every process
    (same torch version). The global torch RNG is forked, so the caller's state is unchanged.

    Args:
        spec: the job's ``model`` field.
        input_shape: shape of one sample, e.g. (1, 8, 8); the model takes [B, *input_shape]
            float32 and returns [B, num_classes] float32 logits.
        num_classes: number of classes C >= 2.
        seed: seeds the parameter initialisation.
        allowed_imports: the building daemon's ``allowed_imports``; an import model whose
            module it does not list is refused before anything is imported.
        daemon: ``coordinator`` or ``worker NAME``, for the refusal's message.
        device: ``"meta"`` builds shapes only, without allocating parameters (to count them
            before a job is admitted).

    Returns:
        The model in training mode, on ``device``, float32.

    Raises:
        ImportNotAllowed: an import model's module is not allowed (PERMISSION_DENIED).
        ModelError: the cnn gets an input shape it does not support, or an imported callable
            cannot be imported, fails, or does not return an ``nn.Module`` (INVALID_ARGUMENT).
    """
    if isinstance(spec, ImportModelSpec):
        check_import("model.import", spec.import_, allowed_imports, daemon)
    shape = tuple(int(d) for d in input_shape)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        if isinstance(spec, MlpSpec):
            model = _mlp(spec.hidden, shape, num_classes)
        elif isinstance(spec, CnnSpec):
            model = _cnn(spec.channels, shape, num_classes)
        else:
            model = _imported(spec)
    return model.float().train()


def _mlp(hidden: Sequence[int], input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Flatten, then Linear + ReLU per hidden width, then a Linear head."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def _cnn(channels: Sequence[int], input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Two 3x3 same-padding conv layers with ReLU, 2x2 max-pools, and a Linear head.

    8x8 inputs pool once after the second conv (-> 4x4); 28x28 inputs pool after each conv
    (-> 7x7), which keeps the head small in both cases.
    """
    pools = _CNN_POOLS.get(input_shape)
    if pools is None:
        raise ModelError(
            f"model cnn: input shape {input_shape} is not supported; expected one of "
            f"{sorted(_CNN_POOLS)} (single-channel 8x8 or 28x28 images); use mlp or import"
        )
    if len(channels) != 2:
        raise ModelError(f"model.channels: expected 2 conv widths, got {len(channels)}")
    c1, c2 = channels
    layers: list[nn.Module] = [nn.Conv2d(1, c1, 3, padding=1), nn.ReLU()]
    if pools == 2:
        layers.append(nn.MaxPool2d(2))
    layers += [nn.Conv2d(c1, c2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten()]
    side = input_shape[1] // 2**pools
    layers.append(nn.Linear(c2 * side * side, num_classes))
    return nn.Sequential(*layers)


def _imported(spec: ImportModelSpec) -> nn.Module:
    """Call ``package.module:callable(**args)`` and check that it returns an nn.Module."""
    target = spec.import_
    factory = _resolve(target)
    try:
        model = factory(**spec.args)
    except Exception as exc:
        raise ModelError(f"model import {target!r}: call failed: {exc!r}") from None
    if not isinstance(model, nn.Module):
        raise ModelError(
            f"model import {target!r}: returned {type(model).__name__}, expected a torch.nn.Module"
        )
    return model


def _resolve(target: str) -> Callable[..., object]:
    """Import ``package.module:attr.path`` and return the callable it names.

    Raises:
        ModelError: the module cannot be imported, an attribute is missing, or the object
            is not callable (INVALID_ARGUMENT).
    """
    module_name, _, attr_path = target.partition(":")
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as exc:
        raise ModelError(
            f"model import {target!r}: cannot import {module_name!r}: {exc!r}"
        ) from None
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise ModelError(f"model import {target!r}: {attr!r} not found") from None
    if not callable(obj):
        raise ModelError(f"model import {target!r}: {type(obj).__name__} is not callable")
    return obj


def count_params(model: nn.Module) -> int:
    """Count the parameter elements of ``model``; works on a model built on the meta device.

    The coordinator admits a job only if this is within ``max_model_params``.
    """
    return sum(p.numel() for p in model.parameters())


def param_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Map the name of every parameter to its shape, in ``model.named_parameters()`` order.

    What ``check_param_arrays`` checks received parameters or gradients against.
    """
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def buffer_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Map the name of every buffer (e.g. BatchNorm running statistics) to its shape.

    In ``model.named_buffers()`` order; names never collide with parameter names.
    """
    return {name: tuple(b.shape) for name, b in model.named_buffers()}


def check_param_arrays(
    arrays: Mapping[str, np.ndarray],
    expected: Mapping[str, tuple[int, ...]],
    what: str = "parameter",
) -> None:
    """Check that received parameters or gradients have exactly the expected names and shapes.

    Args:
        arrays: name -> array, as decoded from the wire.
        expected: name -> shape, from ``param_shapes`` (or ``buffer_shapes``) of the model.
        what: ``parameter`` or ``buffer``, for the messages.

    Raises:
        ValueError: names missing or unknown, or a shape differs; the message names them.
    """
    missing = sorted(expected.keys() - arrays.keys())
    unknown = sorted(arrays.keys() - expected.keys())
    if missing or unknown:
        raise ValueError(f"{what} names differ: missing {missing}, unknown {unknown}")
    for name, shape in expected.items():
        got = tuple(np.shape(arrays[name]))
        if got != shape:
            raise ValueError(f"{what} {name!r}: expected shape {shape}, got {got}")
