"""Training files on the coordinator's disk: checkpoints and saved models.

Checkpoints are (next step, state bytes), written durably.

Both strategies write the same layout, ``DATA_DIR/checkpoints/JOB.ckpt``: 8 bytes of the
step to resume from (little-endian), then the strategy's state (torch.save bytes). A write
is ``shared.private_files.write_private``'s: a temporary file that is fsynced, renamed over
the old checkpoint, and the directory fsynced, so a power cut leaves the old checkpoint or
the new one, never a torn file.
Directories are created 0700 and files 0600: they hold users' models.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from shared.private_files import create_private, private_dir, write_private


def write_checkpoint(path: Path, step: int, state: bytes) -> None:
    """Durably replace the checkpoint at ``path`` with (``step``, ``state``).

    Args:
        path: the checkpoint file; its directory is created if missing.
        step: the step training resumes from (>= 0).
        state: the strategy's state, bytes.

    Raises:
        OSError: the disk refused the write or the fsync.
    """
    private_dir(path.parent)
    write_private(path, (step.to_bytes(8, "little"), state))


def read_checkpoint(path: Path) -> tuple[int, bytes] | None:
    """The (step, state) at ``path``, or None when there is no checkpoint."""
    if not path.exists():
        return None
    data = path.read_bytes()
    return int.from_bytes(data[:8], "little"), data[8:]


def save_model(model: nn.Module, path: Path) -> None:
    """Write ``model.state_dict()`` with ``torch.save`` (load it with ``weights_only=True``).

    Raises:
        OSError: the file cannot be written.
    """
    private_dir(path.parent)
    with create_private(path) as f:
        torch.save(model.state_dict(), f)
