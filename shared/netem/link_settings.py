"""What an emulated link does to a TCP connection, and the ``up --links`` file of them.

Units are decimal, as network people use them: 1 Mbit = 10**6 bits, 1 MB = 10**6 bytes.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shared.config import ConfigError, format_validation_error, load_yaml

BITS_PER_MBIT = 1_000_000
BYTES_PER_MB = 1_000_000


class LinkSettings(BaseModel):
    """One emulated link: delay, jitter, bandwidth cap, resets, and a cap on connections.

    Every setting but ``max_connections`` (the most connections relayed at once) applies to
    each direction on its own: a latency of L ms delays the bytes from the client to the
    target by L and the bytes back by L, so a round trip through the proxy takes 2L longer
    than without it (``netem delay L`` on both ends' egress does the same). The proxy never
    reorders bytes within a connection, jitter or not.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    latency_ms: float = Field(
        0.0,
        ge=0,
        le=60_000,
        description="One-way delay added to each direction, milliseconds (RTT grows by 2x).",
    )
    jitter_ms: float = Field(
        0.0,
        ge=0,
        le=60_000,
        description="Each chunk's delay is latency_ms plus a uniform draw in [-jitter_ms, "
        "+jitter_ms], milliseconds, clamped at 0 and never earlier than the chunk before it "
        "(bytes are never reordered).",
    )
    bandwidth_mbit: float | None = Field(
        None,
        gt=0,
        description="Cap of each direction, megabits (10**6 bits) per second; null: unlimited.",
    )
    reset_every_mb: float | None = Field(
        None,
        gt=0,
        description="Abort (TCP RST) a connection once this many megabytes (10**6 bytes) have "
        "passed through it, both directions counted; null: never.",
    )
    max_connections: int = Field(
        64,
        ge=1,
        le=10_000,
        description="Most connections relayed at once, connections; one more is accepted and "
        "aborted at once (the client sees a TCP RST) and counted (refused_over_cap). Bounds "
        "the proxy's memory: each connection buffers up to 2 x 8 MiB (both directions).",
    )

    def describe(self) -> str:
        """Return a short human description, e.g. ``100 ms ±5 ms, 20 Mbit/s, reset every 4 MB``."""
        parts = [f"{self.latency_ms:g} ms" + (f" ±{self.jitter_ms:g} ms" if self.jitter_ms else "")]
        if self.bandwidth_mbit is not None:
            parts.append(f"{self.bandwidth_mbit:g} Mbit/s")
        if self.reset_every_mb is not None:
            parts.append(f"reset every {self.reset_every_mb:g} MB")
        return ", ".join(parts)

    def cli_args(self) -> list[str]:
        """Return the ``neuroshard link`` flags that give these settings."""
        args = ["--latency-ms", f"{self.latency_ms!r}", "--jitter-ms", f"{self.jitter_ms!r}"]
        if self.bandwidth_mbit is not None:
            args += ["--bandwidth-mbit", f"{self.bandwidth_mbit!r}"]
        if self.reset_every_mb is not None:
            args += ["--reset-every-mb", f"{self.reset_every_mb!r}"]
        return [*args, "--max-connections", str(self.max_connections)]


def parse_links(data: object, where: str = "links") -> list[LinkSettings | None]:
    """Validate a list of link settings, one per worker in order; ``None`` is a direct link.

    Args:
        data: what the YAML file holds: a list of mappings (or nulls).
        where: how errors name the list, e.g. the file name.

    Returns:
        One entry per worker: its link's settings, or None for a direct link.

    Raises:
        ConfigError: not a list, or an entry that is neither null nor valid settings; the
            message names the entry and field, e.g. ``links[2].latency_ms: ...``.
    """
    if not isinstance(data, list):
        raise ConfigError(
            f"{where}: expected a list of link settings (one per worker, null for a direct "
            f"link), got {type(data).__name__}"
        )
    links: list[LinkSettings | None] = []
    for i, entry in enumerate(data):
        if entry is None:
            links.append(None)
            continue
        if not isinstance(entry, dict):
            raise ConfigError(
                f"{where}[{i}]: expected a mapping of link settings or null, "
                f"got {type(entry).__name__}"
            )
        try:
            links.append(LinkSettings.model_validate(entry))
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, f"{where}[{i}].")) from None
    return links


def load_links(path: str | Path) -> list[LinkSettings | None]:
    """Read a YAML file holding a list of link settings (``neuroshard up --links FILE``).

    Raises:
        ConfigError: a missing file, invalid YAML, or an invalid entry (see ``parse_links``);
            the message begins with ``links``.
    """
    data = load_yaml(path)
    return parse_links([] if data == {} else data)
