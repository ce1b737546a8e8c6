"""An asyncio TCP proxy that emulates a network link: latency, jitter, a bandwidth cap, resets.

For each connection it accepts, the proxy dials the target and relays bytes both ways through
one pipe per direction (``LinkSettings`` applies to each direction on its own). A pipe's
reader stamps every chunk it reads with a release time, read time + latency ± jitter, never
earlier than the chunk before it (so bytes are never reordered); the pipe's writer sends each
chunk at its release time, paced to the bandwidth cap. Reading does not wait for writing, so
many chunks are in flight at once and a long delay does not cut throughput, as on a real long
fat pipe. At most ``BUFFER_BYTES`` wait in a pipe; past that the reader stops reading and TCP
flow control pushes back on the sender (so throughput <= BUFFER_BYTES / latency, as with a
TCP window of that size).

Pacing is store-and-forward: a chunk of n bytes leaves at max(its release time, the time the
previous chunk finished) + n / rate, so cumulative bytes / elapsed time never exceeds the rate.
A reset aborts both sockets with SO_LINGER 0, so both peers see a TCP RST (ECONNRESET); bytes
still in flight are lost, as on a real link.

It is byte-transparent, so gRPC (HTTP/2) and anything else over TCP goes through unchanged.

A link can be cut (``cut``: a network partition): its open connections are aborted and new
ones are accepted and aborted at once, until ``heal``. Peers see connection resets and
refusals, as across a partition whose routers answer with resets (a silent one would make
them wait for their deadlines instead).

At most ``settings.max_connections`` connections are relayed at once: one more is aborted
on arrival, before the proxy dials the target or allocates its buffers, and counted in
``refused_over_cap``.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
from dataclasses import dataclass

from shared.logging import get_logger
from shared.netem.link_settings import BITS_PER_MBIT, BYTES_PER_MB, LinkSettings

__all__ = ["BUFFER_BYTES", "CHUNK_BYTES", "LinkCounters", "LinkProxy", "LinkSettings"]

log = get_logger(__name__)

CHUNK_BYTES = 64 * 1024  # largest read from a socket, bytes
BUFFER_BYTES = 8 * 1024 * 1024  # most bytes waiting in one direction of a connection


@dataclass
class LinkCounters:
    """What went through a proxy since it started (bytes count delivered data only)."""

    bytes_to_target: int = 0
    bytes_to_client: int = 0
    connections: int = 0
    resets: int = 0
    refused: int = 0  # connections aborted on arrival while the link was cut
    refused_over_cap: int = 0  # aborted on arrival: max_connections were already open


class _Reset(Exception):
    """A connection passed ``reset_every_mb``: abort it."""


class _Pipe:
    """One direction of a connection: (release time, chunk) pairs from a reader to a writer.

    An empty chunk stands for EOF (the sender half-closed), which is delayed like data.
    """

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        self.queued_bytes = 0
        self.space = asyncio.Event()
        self.space.set()
        self.last_release = 0.0  # loop time of the last chunk's release, seconds
        self.wire_free = 0.0  # loop time the previous chunk finished being paced, seconds

    def put(self, release: float, chunk: bytes) -> None:
        """Queue a chunk; close the gate for the reader past ``BUFFER_BYTES``."""
        self.queue.put_nowait((release, chunk))
        self.queued_bytes += len(chunk)
        if self.queued_bytes >= BUFFER_BYTES:
            self.space.clear()

    def sent(self, n: int) -> None:
        """Account for a chunk of ``n`` bytes written; reopen the gate below the buffer size."""
        self.queued_bytes -= n
        if self.queued_bytes < BUFFER_BYTES:
            self.space.set()


class _Connection:
    """A relayed connection: its two sockets' writers and the bytes counted towards a reset."""

    def __init__(self, client: asyncio.StreamWriter, target: asyncio.StreamWriter) -> None:
        self.writers = (client, target)
        self.bytes = 0

    def abort(self) -> None:
        """Drop both sockets at once, with a TCP RST to each peer."""
        for w in self.writers:
            _abort(w)

    async def close(self) -> None:
        """Close both sockets after what was written is flushed (both directions ended)."""
        for w in self.writers:
            w.close()
        for w in self.writers:
            try:
                await w.wait_closed()
            except OSError:
                pass


class LinkProxy:
    """A TCP proxy from ``listen_host:listen_port`` to ``target_host:target_port``.

    Start it with ``await proxy.start()`` (which returns the bound port; ``listen_port`` 0
    picks a free one) and stop it with ``await proxy.stop()``, which aborts open connections.
    ``counters`` says what went through it.
    """

    def __init__(
        self,
        listen_host: str,
        listen_port: int,
        target_host: str,
        target_port: int,
        settings: LinkSettings,
        rng: random.Random | None = None,
    ) -> None:
        """Describe the proxy; nothing listens before ``start()``.

        Args:
            listen_host: address to accept connections on.
            listen_port: port to accept connections on; 0 picks a free one.
            target_host: host each connection is relayed to.
            target_port: port each connection is relayed to.
            settings: the link's latency, jitter, bandwidth cap and reset period.
            rng: source of the jitter draws (seed one for a repeatable run); default: a new
                unseeded ``random.Random``.
        """
        self.listen_host, self.listen_port = listen_host, listen_port
        self.target_host, self.target_port = target_host, target_port
        self.settings = settings
        self.counters = LinkCounters()
        self._rng = rng or random.Random()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        mbit = settings.bandwidth_mbit
        self._bytes_per_s = None if mbit is None else mbit * BITS_PER_MBIT / 8
        mb = settings.reset_every_mb
        self._reset_bytes = None if mb is None else mb * BYTES_PER_MB
        self.is_cut = False  # partitioned: see ``cut``

    async def start(self) -> int:
        """Listen and relay connections from now on; return the bound port.

        Raises:
            OSError: the listen address cannot be bound.
        """
        self._server = await asyncio.start_server(self._serve, self.listen_host, self.listen_port)
        self.listen_port = int(self._server.sockets[0].getsockname()[1])
        log.info(
            "link_started",
            listen=f"{self.listen_host}:{self.listen_port}",
            target=f"{self.target_host}:{self.target_port}",
            **self.settings.model_dump(),
        )
        return self.listen_port

    async def stop(self) -> None:
        """Stop listening and abort every open connection (their peers see a reset). Idempotent."""
        if self._server is None:
            return
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None
        log.info("link_stopped", **vars(self.counters))

    def cut(self) -> None:
        """Partition the link: abort every open connection, refuse new ones until ``heal``."""
        self.is_cut = True
        for task in list(self._tasks):
            task.cancel()
        log.info("link_cut", connections_aborted=len(self._tasks))

    def heal(self) -> None:
        """End a ``cut``: relay new connections again."""
        self.is_cut = False
        log.info("link_healed", refused=self.counters.refused)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        """Relay one accepted connection to the target until both directions end."""
        if self.is_cut:
            self.counters.refused += 1
            _abort(client_w)
            return
        if len(self._tasks) >= self.settings.max_connections:
            self.counters.refused_over_cap += 1
            if self.counters.refused_over_cap == 1 or self.counters.refused_over_cap % 100 == 0:
                log.warning(
                    "link_connection_refused",
                    reason="max_connections",
                    max_connections=self.settings.max_connections,
                    refused_over_cap=self.counters.refused_over_cap,
                )
            _abort(client_w)
            return
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.counters.connections += 1
        try:
            try:
                target_r, target_w = await asyncio.open_connection(
                    self.target_host, self.target_port
                )
            except OSError as exc:
                log.warning("link_target_unreachable", error=str(exc))
                _abort(client_w)
                return
            await self._relay(_Connection(client_w, target_w), client_r, target_r)
        except asyncio.CancelledError:
            # stop() cancels the connections; the stream server's callback would log the
            # cancellation as an error of this task, so it ends here (both sockets aborted;
            # the client's also when the cancellation came while dialing the target).
            _abort(client_w)
            return
        finally:
            self._tasks.discard(task)

    async def _relay(
        self,
        conn: _Connection,
        client_r: asyncio.StreamReader,
        target_r: asyncio.StreamReader,
    ) -> None:
        """Run both directions; abort both sockets on a reset, an error or cancellation."""
        client_w, target_w = conn.writers
        up, down = _Pipe(), _Pipe()
        tasks = [
            asyncio.create_task(self._read(client_r, up, conn)),
            asyncio.create_task(self._write(up, target_w, to_target=True)),
            asyncio.create_task(self._read(target_r, down, conn)),
            asyncio.create_task(self._write(down, client_w, to_target=False)),
        ]
        clean = False
        try:
            await asyncio.gather(*tasks)
            clean = True
        except _Reset:
            self.counters.resets += 1
            log.info("link_reset", after_bytes=conn.bytes, resets=self.counters.resets)
        except OSError as exc:  # a peer reset or vanished: pass it on to the other one
            log.debug("link_connection_error", error=repr(exc))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if clean:
                await conn.close()
            else:
                conn.abort()

    async def _read(self, reader: asyncio.StreamReader, pipe: _Pipe, conn: _Connection) -> None:
        """Read chunks and queue each with its release time, until EOF (queued too).

        Raises:
            _Reset: the connection passed ``reset_every_mb``.
            OSError: the socket failed (e.g. ECONNRESET).
        """
        loop = asyncio.get_running_loop()
        latency_s, jitter_s = self.settings.latency_ms / 1e3, self.settings.jitter_ms / 1e3
        while True:
            await pipe.space.wait()
            chunk = await reader.read(CHUNK_BYTES)
            now = loop.time()
            conn.bytes += len(chunk)
            if self._reset_bytes is not None and conn.bytes >= self._reset_bytes:
                raise _Reset
            delay_s = latency_s + (self._rng.uniform(-jitter_s, jitter_s) if jitter_s else 0.0)
            # Monotonic per direction: a chunk never overtakes the one read before it.
            pipe.last_release = max(pipe.last_release, now + max(0.0, delay_s))
            pipe.put(pipe.last_release, chunk)
            if not chunk:
                return

    async def _write(self, pipe: _Pipe, writer: asyncio.StreamWriter, to_target: bool) -> None:
        """Write each queued chunk at its release time, paced to the cap; pass EOF on.

        Raises:
            OSError: the socket failed (e.g. ECONNRESET).
        """
        loop = asyncio.get_running_loop()
        while True:
            release, chunk = await pipe.queue.get()
            if not chunk:
                await _sleep_until(loop, release)
                if writer.can_write_eof():
                    writer.write_eof()
                return
            due = release
            if self._bytes_per_s is not None:
                due = max(release, pipe.wire_free) + len(chunk) / self._bytes_per_s
                pipe.wire_free = due
            await _sleep_until(loop, due)
            writer.write(chunk)
            await writer.drain()
            pipe.sent(len(chunk))
            if to_target:
                self.counters.bytes_to_target += len(chunk)
            else:
                self.counters.bytes_to_client += len(chunk)


def _abort(writer: asyncio.StreamWriter) -> None:
    """Drop a socket without flushing it; SO_LINGER 0 makes the kernel send a RST."""
    sock = writer.get_extra_info("socket")
    try:
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:  # already closed: nothing to reset
        pass
    writer.transport.abort()


async def _sleep_until(loop: asyncio.AbstractEventLoop, when: float) -> None:
    """Sleep until the loop's clock reads ``when`` (seconds); return at once if it passed."""
    delay = when - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)
