"""The training controls of a job spec, built from torch: optimizer, lr schedule, precision.

One home for what the parameter server (``strategy: sync``) and the workers' DDP processes
(``strategy: allreduce``) both build from a ``TrainJobSpec``, so that the two strategies step
the same optimizer on the same schedule.
"""

from __future__ import annotations

import contextlib
import math
import pickle
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from shared.config import TrainJobSpec

_AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# What ``torch.load(weights_only=True)`` and the ``load_state_dict`` methods raise on bytes
# that are not a checkpoint of the job's model: truncated, foreign, or of other shapes.
UNLOADABLE: tuple[type[Exception], ...] = (
    pickle.UnpicklingError,
    RuntimeError,
    KeyError,
    TypeError,
    ValueError,
    EOFError,
)


def make_optimizer(spec: TrainJobSpec, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """Build the spec's optimizer over ``params``.

    ``sgd``: ``torch.optim.SGD`` with momentum and (L2) weight decay; ``adam``:
    ``torch.optim.Adam``; ``adamw``: ``torch.optim.AdamW`` (decoupled weight decay,
    Loshchilov & Hutter 2019).

    Args:
        spec: the job; its ``optimizer`` section.
        params: the model's parameters, float32.
    """
    opt = spec.optimizer
    if opt.name == "sgd":
        return torch.optim.SGD(
            params, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay
        )
    if opt.name == "adamw":
        return torch.optim.AdamW(params, lr=opt.lr, weight_decay=opt.weight_decay)
    return torch.optim.Adam(params, lr=opt.lr, weight_decay=opt.weight_decay)


def make_outer_optimizer(
    spec: TrainJobSpec, params: Iterable[nn.Parameter]
) -> torch.optim.Optimizer:
    """The outer optimizer of ``strategy: diloco``: Nesterov SGD over the global parameters.

    ``torch.optim.SGD(lr=outer_lr, momentum=outer_momentum, nesterov=True)`` stepped with the
    averaged pseudo-gradient as the gradient (Douillard et al. 2023, algorithm 1; the paper
    uses lr 0.7, momentum 0.9). Momentum 0 is plain SGD (torch's nesterov needs momentum).

    Args:
        spec: the job; ``outer_lr`` and ``outer_momentum``.
        params: the coordinator's model parameters, float32.
    """
    momentum = spec.outer_momentum
    return torch.optim.SGD(params, lr=spec.outer_lr, momentum=momentum, nesterov=momentum > 0)


def lr_factor(spec: TrainJobSpec, step: int, total_steps: int) -> float:
    """The multiplier of ``optimizer.lr`` for optimizer step ``step`` (from 0).

    Warm-up: ``(step + 1) / warmup_steps`` while ``step < warmup_steps`` (Goyal et al. 2017,
    section 2.2). Then, with ``t`` the fraction of the post-warm-up steps done and ``m`` =
    ``min_lr_factor``: constant 1; cosine ``m + (1 - m) (1 + cos(pi t)) / 2`` (Loshchilov &
    Hutter 2017, SGDR, eq. 5 without restarts); linear ``1 - (1 - m) t``; step
    ``gamma ** ((step - warmup) // step_size)``.

    Args:
        spec: the job; its ``lr_schedule`` section.
        step: optimizer steps taken so far (>= 0).
        total_steps: optimizer steps of the whole job (>= 1).
    """
    sched = spec.lr_schedule
    if step < sched.warmup_steps:
        return (step + 1) / sched.warmup_steps
    after = step - sched.warmup_steps
    span = max(total_steps - sched.warmup_steps, 1)
    t = min(after / span, 1.0)
    m = sched.min_lr_factor
    if sched.name == "cosine":
        return m + (1.0 - m) * (1.0 + math.cos(math.pi * t)) / 2.0
    if sched.name == "linear":
        return 1.0 - (1.0 - m) * t
    if sched.name == "step":
        return float(sched.gamma ** (after // sched.step_size))
    return 1.0


def make_lr_scheduler(
    spec: TrainJobSpec, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``torch.optim.lr_scheduler.LambdaLR`` following :func:`lr_factor`.

    Call ``scheduler.step()`` once after each ``optimizer.step()``. Its ``state_dict`` goes
    into checkpoints with the optimizer's.

    Args:
        spec: the job.
        optimizer: the optimizer built by :func:`make_optimizer`.
        total_steps: optimizer steps of the whole job (>= 1).
    """
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(spec, step, total_steps)
    )


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate of the optimizer's first parameter group."""
    return float(optimizer.param_groups[0]["lr"])


def resolve_device(spec_device: str, cuda_available: bool | None = None) -> torch.device:
    """The device a job trains on in this process.

    Args:
        spec_device: the spec's ``device`` (``auto``, ``cpu``, ``cuda``); the coordinator
            resolves ``auto`` for the whole job before workers see it.
        cuda_available: for tests; None asks ``torch.cuda.is_available()``.

    Raises:
        ValueError: ``cuda`` asked for where no CUDA device exists (FAILED_PRECONDITION).
    """
    has_cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if spec_device == "cuda" and not has_cuda:
        raise ValueError("device: cuda asked for, but this process sees no CUDA device")
    if spec_device == "cuda" or (spec_device == "auto" and has_cuda):
        return torch.device("cuda", torch.cuda.current_device() if has_cuda else 0)
    return torch.device("cpu")


@contextlib.contextmanager
def autocast(precision: str, device: torch.device) -> Iterator[None]:
    """Run the forward pass (and the loss) under ``torch.autocast`` in the spec's precision.

    ``fp32`` runs as is. ``bf16`` and ``fp16`` autocast on ``device.type`` (CPU autocast
    supports both in torch 2.x); parameters stay float32.
    """
    dtype = _AUTOCAST_DTYPES.get(precision)
    if dtype is None:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def make_grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """A ``torch.amp.GradScaler``, enabled only for ``fp16`` (bf16 has fp32's exponent range).

    Disabled, ``scale``/``unscale_``/``step``/``update`` pass through, so callers use one code
    path for every precision.
    """
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
