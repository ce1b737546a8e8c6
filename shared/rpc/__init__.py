"""gRPC helpers shared by both daemons and the client.

This module makes every channel of the code base (``channel``), turns RPC failures into one
line (``error_message``) and holds the daemons' wait for SIGTERM. Its modules: ``codec``
(arrays as raw little-endian bytes, chunked tensor streams), ``daemon_server`` (both daemons'
gRPC server, built, bound and stopped one way), ``interceptors`` (every server interceptor),
``limits`` (message, stream and batch limits), ``peers`` (one channel and stub per worker),
``reflection`` (gRPC server reflection on both daemons) and ``status_table`` (each
servicer's domain exceptions to status codes).
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from grpc import aio

if TYPE_CHECKING:
    from shared.security.transport import ChannelSecurity

# gRPC channel or server options: (name, value) pairs such as ("grpc.enable_retries", 1).
Options: TypeAlias = list[tuple[str, int | str]]

# Retry only UNAVAILABLE, with jittered exponential backoff (gRPC's built-in retry policy,
# https://github.com/grpc/proposal/blob/master/A6-client-retries.md).
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "neuroshard.v1.Coordinator"}],
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


def message_options(max_message_bytes: int) -> Options:
    """Return the channel or server options that set both message size limits.

    gRPC's default receive limit is 4 MiB; gradients, slot copies and data shards need more.

    Args:
        max_message_bytes: the largest message sent or received, bytes.
    """
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def channel(
    address: str,
    max_message_bytes: int = 64 * 1024 * 1024,
    security: ChannelSecurity | None = None,
) -> aio.Channel:
    """Open a grpc.aio channel; every channel of the code base is made here.

    Calls to the coordinator service are retried on UNAVAILABLE by gRPC itself (5 attempts,
    jittered exponential backoff from 50 ms to 1 s); worker calls are retried by their callers.
    Keepalive pings every 30 s while calls are open notice a peer that vanished. A peer that
    could not be reached is dialled again every second at most (gRPC's reconnect backoff
    grows to 120 s by default, and calls fail fast meanwhile: after a long partition healed,
    the coordinator could not reach a worker, nor admit it again, for up to two minutes).

    Args:
        address: ``host:port`` to dial.
        max_message_bytes: the largest message sent or received, bytes.
        security: mutual TLS and/or a bearer token; None dials in plaintext without a token.

    Returns:
        The channel (not connected until its first call).
    """
    options: Options = [
        *message_options(max_message_bytes),
        ("grpc.service_config", _SERVICE_CONFIG),
        ("grpc.enable_retries", 1),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.max_reconnect_backoff_ms", 1_000),
    ]
    if security is None:
        return aio.insecure_channel(address, options=options)
    return security.open(address, options)


async def wait_for_stop_signal(
    extra: asyncio.Event | None = None,
) -> None:
    """Wait for the first SIGTERM or SIGINT: the daemons' main wait before a graceful stop.

    Installs handlers for both signals on the running loop (so they no longer raise
    KeyboardInterrupt).

    Args:
        extra: an event that also ends the wait when set (a worker that cannot go on sets
            it).
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waits = [asyncio.create_task(stop.wait())]
    if extra is not None:
        waits.append(asyncio.create_task(extra.wait()))
    _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()


async def write_ready_file(path: str | None, address: str) -> None:
    """Write a daemon's bound address to ``path``, from a thread, once it serves.

    ``LocalCluster`` polls the file to learn the port a daemon started with port 0 bound.

    Args:
        path: the ``--ready-file``; None or empty writes nothing.
        address: ``host:port`` the daemon serves on.
    """
    if path:
        await asyncio.to_thread(Path(path).write_text, address)


def error_message(exc: BaseException, limit: int = 300) -> str:
    """Describe a failed call in one line for logs, job errors and failure reports.

    Args:
        exc: a gRPC error (anything with ``code()`` and ``details()``) or any exception.
        limit: the most characters returned.

    Returns:
        ``CODE: details`` for a gRPC error, else ``ExceptionType: text``.
    """
    details, code = getattr(exc, "details", None), getattr(exc, "code", None)
    if callable(details) and callable(code):
        text = f"{code().name}: {details()}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return text[:limit]
