"""The client side of the model RPCs: GetModel (stream a saved model to a file) and ListModels.

A model is written to a temporary file beside its target and renamed over it once the
stream ended with the size and SHA-256 its header declared, so a broken stream leaves no
partial file under the target's name. The file is the coordinator's ``torch.save`` of a
state dict: load it with ``torch.load(path, weights_only=True)``.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

from shared.proto import coordinator_pb2, coordinator_pb2_grpc


class ModelStreamError(Exception):
    """The model stream did not start with a header, or did not match it (INTERNAL)."""


def _open_temp(target: Path) -> tuple[BinaryIO, Path]:
    """A new private temporary file beside ``target``: (file, its path)."""
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    return os.fdopen(fd, "wb"), Path(name)


async def model_to_file(
    stub: coordinator_pb2_grpc.CoordinatorStub,
    job_id: str,
    path: str | os.PathLike[str],
    best: bool,
    timeout_s: float | None,
) -> dict[str, Any]:
    """Stream a job's saved model into ``path`` (created or replaced once complete).

    Args:
        stub: the coordinator.
        job_id: the train job.
        path: the file to write; its directory must exist.
        best: the best model by test accuracy rather than the final one.
        timeout_s: deadline of the whole stream, seconds; None: none.

    Returns:
        ``job_id``, ``best``, ``path``, ``bytes`` and ``sha256`` (hex) of the file written.

    Raises:
        grpc.aio.AioRpcError: the stream failed (NOT_FOUND: unknown job, another user's, or
            no such saved model).
        ModelStreamError: no header first, or bytes that do not match it.
        OSError: the file cannot be written.
    """
    target = Path(path)
    f, tmp = await asyncio.to_thread(_open_temp, target)
    try:
        call = stub.GetModel(
            coordinator_pb2.GetModelRequest(job_id=job_id, best=best), timeout=timeout_s
        )
        header: coordinator_pb2.ModelHeader | None = None
        sha, size = hashlib.sha256(), 0
        async for msg in call:
            if msg.WhichOneof("part") == "header":
                header = msg.header
                continue
            if header is None:
                raise ModelStreamError("the model stream did not start with a header")
            sha.update(msg.data)
            size += len(msg.data)
            await asyncio.to_thread(f.write, msg.data)
        if header is None:
            raise ModelStreamError("the model stream ended without a header")
        if size != header.bytes or sha.hexdigest() != header.sha256:
            raise ModelStreamError(
                f"the model stream sent {size} bytes (sha256 {sha.hexdigest()}), its header "
                f"declared {header.bytes} (sha256 {header.sha256})"
            )
        await asyncio.to_thread(_finish, f, tmp, target)
    except BaseException:
        f.close()
        tmp.unlink(missing_ok=True)
        raise
    return {
        "job_id": job_id,
        "best": best,
        "path": str(target),
        "bytes": size,
        "sha256": header.sha256,
    }


def _finish(f: BinaryIO, tmp: Path, target: Path) -> None:
    """Flush, fsync and close the temporary file, then rename it over ``target``."""
    f.flush()
    os.fsync(f.fileno())
    f.close()
    tmp.replace(target)


def models_from_pb(reply: coordinator_pb2.ListModelsResponse) -> list[dict[str, Any]]:
    """Turn a ListModels reply into the list ``model ls --json`` prints.

    Each entry: ``job_id``, ``kind``, ``strategy``, ``best_test_accuracy`` (None when never
    evaluated), ``bytes`` and ``best_bytes`` (0: no such file), ``saved_at`` (Unix seconds).
    """
    return [
        {
            "job_id": m.job_id,
            "kind": m.kind,
            "strategy": m.strategy,
            "best_test_accuracy": (
                None if math.isnan(m.best_test_accuracy) else m.best_test_accuracy
            ),
            "bytes": m.bytes,
            "best_bytes": m.best_bytes,
            "saved_at": m.saved_at,
        }
        for m in reply.models
    ]
