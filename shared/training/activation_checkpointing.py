"""Activation checkpointing of a job's model: each block recomputes its activations in backward.

``activation_checkpointing: true`` trades compute for memory: a block's forward runs under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, which keeps only the block's
inputs and runs its forward again during the backward pass (Chen et al. 2016, "Training Deep
Nets with Sublinear Memory Cost"; torch docs "torch.utils.checkpoint"). The recomputation
replays the same operations on the same inputs with the RNG state restored
(``preserve_rng_state``), so gradients are those of the plain model.

The blocks of a model are its ``blocks`` attribute (an ``nn.ModuleList`` or ``nn.Sequential``,
as transformer stacks usually hold them) or, for an ``nn.Sequential`` without one, its
children. The same blocks are FSDP's units under ``sharding: fsdp``
(``worker.allreduce.fsdp_replica``).

The block's own ``forward`` is wrapped on the instance (not replaced by a wrapper module), so
parameter names and ``state_dict`` keys do not change: a checkpointed model's saved weights
load into the plain architecture.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from shared.training.models import ModelError


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model``: its ``blocks`` attribute's items, or a Sequential's children.

    Args:
        model: the job's model (any device, meta included).

    Returns:
        The blocks in order; empty when the model exposes none.
    """
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, (nn.ModuleList, nn.Sequential)):
        return list(blocks)
    if isinstance(model, nn.Sequential):
        return list(model.children())
    return []


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model``, as :func:`find_blocks`; a model without any is an error.

    Args:
        model: the job's model (any device, meta included).

    Raises:
        ModelError: the model has neither a non-empty ``blocks`` ``nn.ModuleList`` /
            ``nn.Sequential`` nor is itself a non-empty ``nn.Sequential`` (INVALID_ARGUMENT).
    """
    found = find_blocks(model)
    if not found:
        raise ModelError(
            f"model: {type(model).__name__} exposes no blocks (a `blocks` nn.ModuleList or "
            "nn.Sequential attribute, or the model an nn.Sequential), which "
            "activation_checkpointing needs"
        )
    return found


def checkpoint_blocks(model: nn.Module) -> int:
    """Make every block of ``model`` recompute its activations in backward, in place.

    While training with gradients on, a block's forward runs under
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``; in eval mode or under
    ``torch.no_grad`` it runs as before. Call it once, before wrapping the model in DDP or
    sharding it.

    Args:
        model: the job's model.

    Returns:
        The number of blocks checkpointed.

    Raises:
        ModelError: as :func:`model_blocks`.
    """
    blocks = model_blocks(model)
    for block in blocks:
        block.forward = functools.partial(_checkpointed, block, block.forward)
    return len(blocks)


def _checkpointed(block: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if not (block.training and torch.is_grad_enabled()):
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
