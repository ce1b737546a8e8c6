"""Model weights as files: a ``torch.save``'d state dict, read without running pickled code.

Both a train job's saved model (``coordinator.training.saved_models``) and an uploaded
weights file (``neuroshard data put W.pt``, stored as ``NAME.pt`` in the first data root) are
read here: the size is checked against the cap before the file is opened, the file is loaded
with ``torch.load(weights_only=True)`` onto the CPU, and it must be a mapping of names to
tensors.
"""

from __future__ import annotations

import struct
import zipfile
from pathlib import Path

import torch

from coordinator.datasets.dataset_check import ArrayInfo
from shared.training.controls import UNLOADABLE

WEIGHTS_SUFFIX = ".pt"  # an uploaded state dict is stored as NAME.pt

# Besides UNLOADABLE, torch.load on bytes that are not a torch.save file fails in the legacy
# unpickler's struct reads (a short file) or in zipfile (a torn archive): refusals of the
# file, not faults of the coordinator.
_UNREADABLE: tuple[type[Exception], ...] = (*UNLOADABLE, struct.error, zipfile.BadZipFile, OSError)


class StateDictError(ValueError):
    """Not a readable state dict, or over the size cap (INVALID_ARGUMENT); names the file."""


def read_state_dict(path: Path, label: str, max_bytes: int) -> dict[str, torch.Tensor]:
    """Read a ``torch.save``'d state dict with ``weights_only=True``, onto the CPU.

    Args:
        path: the file.
        label: how messages name it (``init.job``, ``w.pt``), never the coordinator's path.
        max_bytes: ``max_dataset_bytes``: a larger file is refused before it is opened.

    Raises:
        FileNotFoundError: no such file.
        StateDictError: over ``max_bytes``, unreadable, or not a mapping of names to tensors.
    """
    size = path.stat().st_size
    if size > max_bytes:
        raise StateDictError(
            f"{label}: the saved model is {size} bytes, over the coordinator's "
            f"max_dataset_bytes {max_bytes}"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except _UNREADABLE as exc:
        raise StateDictError(f"{label}: not a readable state dict ({exc})") from None
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()
    ):
        raise StateDictError(f"{label}: not a state dict (a mapping of names to tensors)")
    return state


def check_weights(path: Path, label: str, max_bytes: int) -> tuple[str, list[ArrayInfo]]:
    """Validate an uploaded weights file; return its kind (``weights``) and its tensors.

    Args:
        path: the complete upload.
        label: its name in messages (``NAME.pt``).
        max_bytes: ``max_dataset_bytes``.

    Raises:
        StateDictError: see ``read_state_dict``; also an empty state dict.
    """
    state = read_state_dict(path, label, max_bytes)
    if not state:
        raise StateDictError(f"{label}: the state dict holds no tensor")
    arrays = [
        ArrayInfo(name, str(t.dtype).removeprefix("torch."), tuple(t.shape))
        for name, t in state.items()
    ]
    return "weights", arrays
