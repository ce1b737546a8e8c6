"""Frames between the worker daemon and its training child process, over stdin/stdout pipes.

A frame is one JSON object on one line, optionally followed by ``nbytes`` raw bytes (a state
of torch.save bytes, a data file name never: paths travel in the JSON). Both sides are here:
the child reads and writes blocking file objects, the daemon asyncio streams. Nothing is
unpickled: JSON and raw bytes only.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any, BinaryIO

# A frame's JSON line may not exceed this (the daemon's reader limit), bytes.
MAX_LINE_BYTES = 1 << 20


class PipeClosed(EOFError):
    """The other side closed the pipe (it exited, or was killed)."""


@dataclass
class Frame:
    """One message: a ``type`` and fields, plus raw bytes when it carries a payload."""

    type: str
    fields: dict[str, Any] = field(default_factory=dict)
    payload: bytes = b""

    def encode(self) -> bytes:
        """The frame as written to a pipe: the JSON line, then the payload."""
        head = {"type": self.type, **self.fields, "nbytes": len(self.payload)}
        return json.dumps(head, separators=(",", ":")).encode() + b"\n" + self.payload


def _decode_head(line: bytes) -> tuple[dict[str, Any], int]:
    if not line:
        raise PipeClosed("pipe closed")
    head = json.loads(line)
    if not isinstance(head, dict) or not isinstance(head.get("type"), str):
        raise ValueError(f"not a frame: {line[:80]!r}")
    nbytes = int(head.pop("nbytes", 0))
    if nbytes < 0:
        raise ValueError(f"negative payload size {nbytes}")
    return head, nbytes


class BlockingPipe:
    """The child's side: frames from a binary reader, to a binary writer (thread-safe writes)."""

    def __init__(self, reader: BinaryIO, writer: BinaryIO) -> None:
        """Read frames from ``reader`` (stdin) and write them to ``writer`` (stdout)."""
        self._reader, self._writer = reader, writer
        self._lock = threading.Lock()

    def read(self) -> Frame:
        """The next frame. Raises: PipeClosed at end of input."""
        head, nbytes = _decode_head(self._reader.readline(MAX_LINE_BYTES))
        payload = self._reader.read(nbytes) if nbytes else b""
        if len(payload) != nbytes:
            raise PipeClosed("pipe closed inside a payload")
        return Frame(head.pop("type"), head, payload)

    def write(self, frame: Frame) -> None:
        """Write one frame and flush."""
        data = frame.encode()
        with self._lock:
            self._writer.write(data)
            self._writer.flush()


class AsyncPipe:
    """The daemon's side: frames from the child's stdout, to its stdin."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read frames from ``reader`` (the child's stdout), write to ``writer`` (its stdin)."""
        self._reader, self._writer = reader, writer

    async def read(self) -> Frame:
        """The next frame. Raises: PipeClosed when the child's stdout closes."""
        head, nbytes = _decode_head(await self._reader.readline())
        try:
            payload = await self._reader.readexactly(nbytes) if nbytes else b""
        except asyncio.IncompleteReadError:
            raise PipeClosed("pipe closed inside a payload") from None
        return Frame(head.pop("type"), head, payload)

    async def write(self, frame: Frame) -> None:
        """Write one frame and wait until it is handed to the pipe.

        Raises:
            PipeClosed: the child's stdin is closed (it exited).
        """
        try:
            self._writer.write(frame.encode())
            await self._writer.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise PipeClosed(str(exc)) from None
