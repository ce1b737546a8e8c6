"""The ``memory`` job spec: a store filled, then iterations of accesses (Zipf or a trace)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from shared.config.fields import DATA_PATH_REF, ConfigModel

# Bytes the coordinator holds per access of one memory-job batch, at most: the Zipf draw's
# float64 and int64 temporaries, the ids and boosts, and the router's positions and owners
# (measured about 75 at 10**7 accesses). Admission caps access.batch x ACCESS_BYTES
# (max_access_batch_bytes).
ACCESS_BYTES = 96


class ZipfAccess(ConfigModel):
    """A memory job's accesses: Zipf-popular ids of the store, as YCSB's scrambled Zipfian.

    Ranks come from Gray et al.'s generator ("Quickly generating billion-record synthetic
    databases", SIGMOD 1994) and are scattered over the stored ids by a seeded permutation,
    so hot ids do not cluster.
    """

    distribution: Literal["zipf"] = "zipf"
    alpha: float = Field(
        0.99,
        gt=0,
        lt=1,
        description="Zipf constant theta in (0, 1) (YCSB's default 0.99; Gray et al.'s "
        "generator needs theta < 1).",
    )
    batch: int = Field(100_000, ge=1, le=100_000_000, description="Accesses per iteration.")
    boost: float = Field(0.05, ge=0, le=1, description="Boost added per access.")


class TraceAccess(ConfigModel):
    """A memory job's accesses replayed from an ``.npy`` of ids in the data roots."""

    trace: str = Field(
        max_length=4096,
        description=".npy of ids: [iterations, batch] or [batch] uint64, inside the "
        "coordinator's data_roots.",
        json_schema_extra=DATA_PATH_REF,
    )
    boost: float = Field(0.05, ge=0, le=1)


def _access_tag(v: Any) -> str:
    """A mapping with a ``trace`` key is a trace; anything else is the Zipf stream."""
    return (
        "trace" if (isinstance(v, dict) and "trace" in v) or isinstance(v, TraceAccess) else "zipf"
    )


AccessField = Annotated[
    Annotated[ZipfAccess, Tag("zipf")] | Annotated[TraceAccess, Tag("trace")],
    Discriminator(_access_tag),
]


class MemoryJobSpec(ConfigModel):
    """A ``memory`` job: iterations of reinforce, decay, quality and top-k over the store.

    The store is filled first with ``memories`` generated memories, or those of ``load``;
    each iteration then reinforces the ids of one batch of accesses, decays every memory,
    and asks for quality statistics and the top-k, timing each iteration.
    """

    kind: Literal["memory"] = Field(description="'memory'.")
    name: str = Field("memory", max_length=128, description="A label for people.")
    workers: int = Field(1, ge=1, le=1024, description="Alive workers the job waits for.")
    memories: int = Field(1_000_000, ge=1, le=1_000_000_000, description="Memories to generate.")
    load: str | None = Field(
        None,
        max_length=4096,
        description=".npz with arrays ids, strengths to load instead, inside the "
        "coordinator's data_roots.",
        json_schema_extra=DATA_PATH_REF,
    )
    iterations: int = Field(
        100, ge=1, le=10_000_000, description="Rounds of reinforce, decay, quality, top-k."
    )
    access: AccessField = Field(
        default_factory=ZipfAccess,
        description="{distribution: zipf, alpha, batch, boost} or {trace: F.npy, boost}.",
    )
    decay_rate: float = Field(0.001, ge=0, le=1, description="Strength subtracted per iteration.")
    topk: int = Field(100, ge=1, description="k of the top-k query each iteration.")
    seed: int = Field(0, ge=0, description="Seeds the generated memories and access stream.")
