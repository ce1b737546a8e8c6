"""A model's state dict as raw bytes behind a small header: allreduce's epoch-end state.

Rank 0 of an allreduce job sends its model at every epoch's end for the coordinator to
evaluate (``worker.allreduce.allreduce_child``); on the digits MLP an epoch is 15 steps of
~1.3 ms, and ``torch.save`` (0.4 ms on rank 0) and ``torch.load`` (0.7 ms on the
coordinator) of the 72 KB state cost more CPU than the copy of the bytes (issue 25,
docs/bench-train.md). The layout, no pickle:

- ``MAGIC`` (8 bytes), then the header's length (4 bytes, little-endian), then the header:
  UTF-8 JSON, a list of ``[name, dtype, shape]`` (``dtype`` as ``str(torch.dtype)`` without
  its ``torch.`` prefix), in the state dict's order;
- then every tensor's elements, contiguous, in the header's order, in the machine's byte order
  (both ends of a job are little-endian x86-64 or arm64).

Checkpoints and final states stay ``torch.save`` bytes (``is_packed`` tells them apart).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch
from torch import nn

MAGIC = b"NSPACK1\n"
_HEADER_LEN = 4


class PackedStateError(ValueError):
    """The bytes are not a packed state of the model (INTERNAL: a worker sent them)."""


def is_packed(data: bytes) -> bool:
    """True when ``data`` is ``pack_state``'s, not ``torch.save``'s."""
    return data[: len(MAGIC)] == MAGIC


def pack_state(state: Mapping[str, torch.Tensor]) -> bytes:
    """The state dict's tensors as one byte string (copied to the CPU).

    Args:
        state: name -> tensor (parameters and buffers, any dtype and device).
    """
    tensors = [(name, t.detach().to("cpu").contiguous()) for name, t in state.items()]
    header = json.dumps(
        [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors]
    ).encode()
    pieces = [MAGIC, len(header).to_bytes(_HEADER_LEN, "little"), header]
    pieces += [t.reshape(-1).view(torch.uint8).numpy().tobytes() for _, t in tensors]
    return b"".join(pieces)


def load_packed(model: nn.Module, data: bytes) -> None:
    """Load ``pack_state`` bytes into ``model`` (``load_state_dict``, strict).

    Args:
        model: the module whose state dict was packed (same names and shapes).
        data: ``pack_state``'s bytes.

    Raises:
        PackedStateError: not packed bytes, a header that does not parse, fewer bytes than
            it names, or tensors that do not fit ``model`` (a name missing or extra, a
            shape that differs).
    """
    if not is_packed(data):
        raise PackedStateError("not a packed state")
    at = len(MAGIC) + _HEADER_LEN
    size = int.from_bytes(data[len(MAGIC) : at], "little")
    try:
        header = json.loads(data[at : at + size])
        dtypes = [getattr(torch, dtype) for _, dtype, _ in header]
    except (ValueError, TypeError, AttributeError) as exc:
        raise PackedStateError(f"a packed state's header does not parse: {exc}") from None
    buf = bytearray(data[at + size :])  # writable: torch.frombuffer warns on bytes
    state, offset = {}, 0
    for (name, _, shape), dtype in zip(header, dtypes, strict=True):
        n = 1
        for d in shape:
            n *= int(d)
        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        if offset + nbytes > len(buf):
            raise PackedStateError(f"a packed state ends inside tensor {name!r}")
        if nbytes == 0:  # frombuffer refuses an empty count
            state[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=offset)
        state[name] = flat.view(dtype).reshape(shape)
        offset += nbytes
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise PackedStateError(f"a packed state does not fit the model: {exc}") from None
