"""gRPC helpers shared by both daemons and the client: channels, options, error text and the
daemons' stop signal. Subpackages: ``codec`` (arrays as bytes), ``interceptors`` (every
server interceptor), ``limits`` (request limits), ``peers`` (a channel pool to workers)."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpc import aio

if TYPE_CHECKING:
    from shared.security.transport import ChannelSecurity

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


def message_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Channel/server options that raise gRPC's 4 MiB default message limits."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def channel(
    address: str,
    max_message_bytes: int = 64 * 1024 * 1024,
    security: ChannelSecurity | None = None,
) -> aio.Channel:
    """A grpc.aio channel with retries of UNAVAILABLE on the coordinator service: plaintext
    without ``security``, else mutual TLS and/or a bearer token as it says. Every channel of
    the code base is made here."""
    options = [
        *message_options(max_message_bytes),
        ("grpc.service_config", _SERVICE_CONFIG),
        ("grpc.enable_retries", 1),
        ("grpc.keepalive_time_ms", 30_000),
    ]
    if security is None:
        return aio.insecure_channel(address, options=options)
    return security.open(address, options)


async def wait_for_stop_signal(
    extra: asyncio.Event | None = None,
) -> None:
    """Return on the first SIGTERM or SIGINT (or when ``extra`` is set): the daemons' main
    wait before a graceful shutdown."""
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
    """Write the bound address to ``path`` (used by the local cluster to find daemons)."""
    if path:
        await asyncio.to_thread(Path(path).write_text, address)


def error_message(exc: BaseException, limit: int = 300) -> str:
    """One line for an RPC failure: ``CODE: details`` for a gRPC error, else the exception's
    text; at most ``limit`` characters."""
    details, code = getattr(exc, "details", None), getattr(exc, "code", None)
    if callable(details) and callable(code):
        text = f"{code().name}: {details()}"
    else:
        text = f"{type(exc).__name__}: {exc}"
    return text[:limit]
