"""A model's state dict as safetensors bytes: allreduce's epoch-end state.

Rank 0 of an allreduce job sends its model at every epoch's end for the coordinator to
evaluate (``worker.allreduce.allreduce_child``); on the digits MLP an epoch is 15 steps of
~1.3 ms, and ``torch.save`` (0.4 ms on rank 0) and ``torch.load`` (0.7 ms on the
coordinator) of the 72 KB state cost more CPU than the copy of the bytes (issue 25,
docs/bench-train.md). safetensors (https://huggingface.co/docs/safetensors) is raw tensor
bytes behind a JSON header: no pickle, and its reader allocates only what the header names
within the bytes received.

Checkpoints and final states stay ``torch.save`` bytes (``is_packed`` tells them apart:
safetensors starts with its header's length, 8 bytes little-endian, then the JSON's ``{``;
``torch.save`` writes a zip archive, ``PK``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

_HEADER_LEN = 8  # safetensors: the JSON header's length, u64 little-endian, then the header


class PackedStateError(ValueError):
    """The bytes are not a packed state of the model (INTERNAL: a worker sent them)."""


def is_packed(data: bytes) -> bool:
    """True when ``data`` is ``pack_state``'s (safetensors), not ``torch.save``'s (a zip)."""
    return data[_HEADER_LEN : _HEADER_LEN + 1] == b"{"


def pack_state(state: Mapping[str, torch.Tensor]) -> bytes:
    """The state dict's tensors as safetensors bytes (copied to the CPU).

    Args:
        state: name -> tensor (parameters and buffers, any dtype and device). Tied tensors
            (one storage under two names) are written once per name.
    """
    # clone(): safetensors refuses tensors that share a storage (tied weights).
    return save_safetensors(
        {name: t.detach().to("cpu").contiguous().clone() for name, t in state.items()}
    )


def load_packed(model: nn.Module, data: bytes) -> None:
    """Load ``pack_state`` bytes into ``model`` (``load_state_dict``, strict).

    Args:
        model: the module whose state dict was packed (same names and shapes).
        data: ``pack_state``'s bytes.

    Raises:
        PackedStateError: not safetensors bytes, bytes safetensors refuses (a header that
            does not parse, fewer bytes than it names), or tensors that do not fit ``model``
            (a name missing or extra, a shape that differs).
    """
    if not is_packed(data):
        raise PackedStateError("not a packed state")
    try:
        state = load_safetensors(data)
    except SafetensorError as exc:
        raise PackedStateError(f"a packed state does not parse: {exc}") from None
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise PackedStateError(f"a packed state does not fit the model: {exc}") from None
