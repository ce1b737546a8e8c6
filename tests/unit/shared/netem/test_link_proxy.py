"""The link proxy against an echo server on loopback: delay, pacing, resets, order, EOF."""

from __future__ import annotations

import asyncio
import random
import statistics
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from pydantic import ValidationError

from shared.config import ConfigError
from shared.netem.link_proxy import LinkProxy, LinkSettings
from shared.netem.link_settings import parse_links

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Echo every byte back; half-close after the client does."""
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
        writer.write_eof()
        await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def count_then_ack(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read until EOF, then answer the number of bytes read (8 bytes, little endian)."""
    n = 0
    while chunk := await reader.read(65536):
        n += len(chunk)
    writer.write(struct.pack("<Q", n))
    await writer.drain()
    writer.close()


async def serve(handler: Handler) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.fixture
async def linked() -> AsyncIterator[Callable[..., Awaitable[tuple[LinkProxy, int]]]]:
    """Factory: a server running ``handler`` behind a proxy; yields (proxy, proxy port)."""
    servers: list[asyncio.Server] = []
    proxies: list[LinkProxy] = []

    async def make(settings: LinkSettings, handler: Handler = echo) -> tuple[LinkProxy, int]:
        server, port = await serve(handler)
        servers.append(server)
        proxy = LinkProxy("127.0.0.1", 0, "127.0.0.1", port, settings, rng=random.Random(7))
        proxies.append(proxy)
        return proxy, await proxy.start()

    yield make
    for proxy in proxies:
        await proxy.stop()
    for server in servers:
        server.close()
        await server.wait_closed()


async def test_round_trip_time_grows_by_twice_the_latency(linked) -> None:
    proxy, port = await linked(LinkSettings(latency_ms=25))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    rtts_s = []
    for i in range(10):
        start = time.perf_counter()
        writer.write(b"ping%04d" % i)
        await writer.drain()
        assert await reader.readexactly(8) == b"ping%04d" % i
        rtts_s.append(time.perf_counter() - start)
    writer.close()
    await writer.wait_closed()
    median_ms = statistics.median(rtts_s) * 1e3
    print(f"median RTT through a 25 ms link: {median_ms:.1f} ms")
    assert 40.0 <= median_ms <= 60.0  # 2 x 25 ms within 20%
    assert proxy.counters.bytes_to_target == proxy.counters.bytes_to_client == 80


@pytest.mark.parametrize("latency_ms", [0, 20])
async def test_throughput_is_capped_at_the_bandwidth(linked, latency_ms: float) -> None:
    # 20 Mbit/s = 2.5 MB/s: 2.5 MB take 1 s; a 20 ms delay must not cut throughput
    # (chunks are pipelined), it only adds one trip of 2 x 20 ms to the exchange.
    proxy, port = await linked(
        LinkSettings(latency_ms=latency_ms, bandwidth_mbit=20), handler=count_then_ack
    )
    payload = bytes(2_500_000)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.perf_counter()
    writer.write(payload)
    writer.write_eof()
    (received,) = struct.unpack("<Q", await reader.readexactly(8))
    elapsed_s = time.perf_counter() - start - 2 * latency_ms / 1e3
    writer.close()
    await writer.wait_closed()
    mbit_s = received * 8 / elapsed_s / 1e6
    print(f"throughput through a 20 Mbit/s, {latency_ms} ms link: {mbit_s:.1f} Mbit/s")
    assert received == len(payload)
    assert 16.0 <= mbit_s <= 24.0
    assert proxy.counters.bytes_to_target == len(payload)


async def test_a_connection_is_reset_after_reset_every_mb(linked) -> None:
    proxy, port = await linked(LinkSettings(reset_every_mb=1))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    with pytest.raises(ConnectionResetError):
        for _ in range(40):  # 4 MB out, echoed back: 8 MB both ways if never reset
            writer.write(bytes(100_000))
            await writer.drain()
            await reader.readexactly(100_000)
    writer.close()
    assert proxy.counters.resets == 1
    assert proxy.counters.bytes_to_target + proxy.counters.bytes_to_client < 1_000_000
    # The next connection starts counting from zero.
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"x" * 1000)
    assert await reader.readexactly(1000) == b"x" * 1000
    writer.close()
    await writer.wait_closed()


async def test_jitter_never_reorders_bytes(linked) -> None:
    # Jitter as large as the latency: a later chunk often draws a shorter delay.
    _, port = await linked(LinkSettings(latency_ms=5, jitter_ms=5))
    stream = b"".join(struct.pack("<I", i) for i in range(20_000))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def send() -> None:
        for offset in range(0, len(stream), 400):
            writer.write(stream[offset : offset + 400])
            await writer.drain()
            await asyncio.sleep(0)  # let the proxy read each piece on its own
        writer.write_eof()

    sender = asyncio.create_task(send())
    echoed = await reader.read(-1)  # to EOF: the echo server half-closes after us
    await sender
    writer.close()
    await writer.wait_closed()
    assert echoed == stream


async def test_half_close_is_passed_on_after_the_data(linked) -> None:
    proxy, port = await linked(LinkSettings(latency_ms=5))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"last words")
    writer.write_eof()
    assert await reader.read(-1) == b"last words"
    writer.close()
    await writer.wait_closed()
    assert proxy.counters.resets == 0


async def test_stop_aborts_open_connections(linked) -> None:
    proxy, port = await linked(LinkSettings())
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"hi")
    assert await reader.readexactly(2) == b"hi"
    await proxy.stop()
    with pytest.raises(ConnectionResetError):
        await reader.read(1)
    writer.close()


async def test_an_unreachable_target_resets_the_client() -> None:
    server, dead_port = await serve(echo)
    server.close()
    await server.wait_closed()
    proxy = LinkProxy("127.0.0.1", 0, "127.0.0.1", dead_port, LinkSettings())
    port = await proxy.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        with pytest.raises(ConnectionResetError):
            await reader.read(1)
        writer.close()
        assert proxy.counters.connections == 1
    finally:
        await proxy.stop()


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"latency_ms": -1}, "greater than or equal to 0"),
        ({"jitter_ms": "lots"}, "valid number"),
        ({"bandwidth_mbit": 0}, "greater than 0"),
        ({"reset_every_mb": -4}, "greater than 0"),
        ({"latency": 5}, "Extra inputs are not permitted"),
    ],
)
def test_invalid_settings_are_refused(entry: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        LinkSettings.model_validate(entry)


def test_links_errors_name_the_entry_and_field() -> None:
    with pytest.raises(ConfigError, match=r"^links\[2\]\.latency_ms: .*greater than or equal"):
        parse_links([None, {"latency_ms": 1}, {"latency_ms": -5}])
    with pytest.raises(ConfigError, match=r"^links\[0\]\.delay: Extra inputs"):
        parse_links([{"delay": 1}])
    with pytest.raises(ConfigError, match=r"^links\[1\]: expected a mapping"):
        parse_links([None, 5])
    with pytest.raises(ConfigError, match=r"^links: expected a list"):
        parse_links({"latency_ms": 1})


def test_links_parse_in_order_with_null_for_direct() -> None:
    links = parse_links([{"latency_ms": 1, "bandwidth_mbit": 1000}, None])
    assert links == [LinkSettings(latency_ms=1, bandwidth_mbit=1000), None]
    assert links[0] is not None and links[0].describe() == "1 ms, 1000 Mbit/s"
