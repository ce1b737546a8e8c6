"""Model construction for training jobs: the built-in mlp and cnn, or a listed entry point.

The built-ins hold no BatchNorm or Dropout: their forward pass depends only on the parameters
and the batch, so averaging per-shard gradients equals one gradient over the global batch.
Initialisation is seeded without touching the caller's global RNG state.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

from shared.config import CnnSpec, EntryModelSpec, MlpSpec, TrainJobSpec
from shared.training.entry_points import EntryPointError, check_entries, resolve_entry_point

# Input shapes the cnn accepts, with the number of 2x2 max-pools that suit each size.
_CNN_POOLS: dict[tuple[int, ...], int] = {(1, 8, 8): 1, (1, 28, 28): 2}


class ModelError(ValueError):
    """A model cannot be built for the job's data; the message says why (INVALID_ARGUMENT)."""


def check_model_entry(
    spec: TrainJobSpec,
    allowed_models: Mapping[str, str],
    daemon: str = "coordinator",
    allowed_losses: Mapping[str, str] | None = None,
) -> None:
    """Check every entry point a train spec names against a daemon's tables, calling nothing.

    Lets a worker refuse a job before it loads data (``build_model`` checks again).
    ``allowed_losses`` is the daemon's loss table (``loss: {entry: NAME}``).

    Raises:
        EntryPointRefused: an entry not listed or not usable (PERMISSION_DENIED).
        ModelError: an entry's args do not fit its signature, or its module cannot be
            imported (INVALID_ARGUMENT).
    """
    try:
        tables = {"allowed_models": allowed_models, "allowed_losses": allowed_losses or {}}
        check_entries(spec, tables, daemon)
    except EntryPointError as exc:
        raise ModelError(str(exc)) from None


def build_model(
    spec: MlpSpec | CnnSpec | EntryModelSpec,
    input_shape: Sequence[int],
    num_classes: int,
    seed: int,
    allowed_models: Mapping[str, str] | None = None,
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
        allowed_models: the building daemon's ``allowed_models`` (entry name ->
            ``package.module:function``); an entry it does not list is refused before
            anything is imported, and the entry's args are checked against its signature
            before it is called.
        daemon: ``coordinator`` or ``worker NAME``, for the refusal's message.
        device: ``"meta"`` builds shapes only, without allocating parameters (to count them
            before a job is admitted).

    Returns:
        The model in training mode, on ``device``, float32.

    Raises:
        EntryPointRefused: an entry not listed, or not a public function or class defined
            in its listed module (PERMISSION_DENIED).
        ModelError: the cnn gets an input shape it does not support; an entry's args do not
            fit its signature, its module cannot be imported, the call fails or does not
            return an ``nn.Module`` (INVALID_ARGUMENT).
    """
    factory = None
    if isinstance(spec, EntryModelSpec):
        try:
            factory = resolve_entry_point(
                "model", spec.entry, allowed_models or {}, spec.args, daemon
            )
        except EntryPointError as exc:
            raise ModelError(str(exc)) from None
    shape = tuple(int(d) for d in input_shape)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        if isinstance(spec, MlpSpec):
            model = _mlp(spec.hidden, shape, num_classes)
        elif isinstance(spec, CnnSpec):
            model = _cnn(spec.channels, shape, num_classes)
        else:
            assert factory is not None
            model = _from_entry(spec.entry, factory)
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
            f"{sorted(_CNN_POOLS)} (single-channel 8x8 or 28x28 images); use mlp or an entry"
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


def _from_entry(entry: str, factory: Callable[[], object]) -> nn.Module:
    """Call a resolved entry point (args bound) and check that it returns an nn.Module."""
    try:
        model = factory()
    except Exception as exc:
        raise ModelError(f"model.entry: {entry!r}: call failed: {exc!r}") from None
    if not isinstance(model, nn.Module):
        raise ModelError(
            f"model.entry: {entry!r}: returned {type(model).__name__}, expected a torch.nn.Module"
        )
    return model


def count_params(model: nn.Module) -> int:
    """Count the parameter elements of ``model``; works on a model built on the meta device.

    The coordinator admits a job only if this is within ``max_model_params``.
    """
    return sum(p.numel() for p in model.parameters())


def activation_bytes(
    model: nn.Module,
    input_shape: Sequence[int],
    rows: int,
    dtype: torch.dtype = torch.float32,
) -> int | None:
    """Estimate the activation memory of one forward pass of ``rows`` samples, bytes.

    Runs the forward pass on torch's ``meta`` device (shapes only, nothing allocated) and adds
    the input batch's bytes to the output bytes of every leaf module: the tensors autograd
    keeps for the backward pass of one micro-batch, give or take the last layer's.

    Args:
        model: built on the meta device (``build_model(..., device="meta")``).
        input_shape: shape of one sample.
        rows: samples in the micro-batch (the job's ``batch_size``).
        dtype: of the input (int64 for a language model's tokens).

    Returns:
        The estimate in bytes, or None when the model's forward pass does not run on the meta
        device (an operator's model with data-dependent code); then only the parameter cap
        bounds it.
    """
    total = [rows * math.prod(input_shape) * torch.empty((), dtype=dtype).element_size()]

    def count(_m: nn.Module, _inputs: object, output: object) -> None:
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, torch.Tensor):
                total[0] += t.numel() * t.element_size()

    leaves = [m for m in model.modules() if not any(True for _ in m.children())]
    handles = [m.register_forward_hook(count) for m in leaves]
    try:
        with torch.no_grad():
            model(torch.zeros((rows, *input_shape), dtype=dtype, device="meta"))
    except Exception:
        return None
    finally:
        for h in handles:
            h.remove()
    return total[0]


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
