"""The sealed rendezvous store: what a writer without the generation's secret can do to it."""

from __future__ import annotations

import pytest
from torch.distributed import HashStore  # type: ignore[attr-defined]

from worker.allreduce.rendezvous_store import RendezvousTampered, SealedStore, gloo_interface

SECRET = "5e" * 32
OTHER = "a1" * 32


def test_names_and_values_reveal_nothing_and_round_trip() -> None:
    shared = HashStore()
    store = SealedStore(shared, SECRET, 0)

    store.set("default_pg/0//cpu//0/1", b"127.0.0.1:4242")

    name = store.name("default_pg/0//cpu//0/1")
    assert shared.num_keys() == 1 and shared.check([name]) and len(name) == 64
    assert not shared.check(["default_pg/0//cpu//0/1"])
    assert b"127.0.0.1" not in shared.get(name)
    assert store.get("default_pg/0//cpu//0/1") == b"127.0.0.1:4242"
    assert store.check(["default_pg/0//cpu//0/1"]) and not store.check(["absent"])


@pytest.mark.parametrize(
    "writer",
    [
        lambda shared, name: shared.set(name, b"127.0.0.1:6666"),  # a plain forged value
        lambda shared, name: shared.set(name, b""),  # an emptied one
        # sealed under another secret, or copied from another generation of the same secret
        lambda shared, name: shared.set(name, _sealed(OTHER, 0, name)),
        lambda shared, name: shared.set(name, _sealed(SECRET, 1, name)),
    ],
)
def test_a_value_not_sealed_by_this_generation_is_refused(writer) -> None:
    shared = HashStore()
    store = SealedStore(shared, SECRET, 0)
    store.set("addr", b"127.0.0.1:4242")
    name = store.name("addr")

    writer(shared, name)

    with pytest.raises(RendezvousTampered, match="without the generation's secret"):
        store.get("addr")


def _sealed(secret: str, generation: int, name: str) -> bytes:
    """A value as another (secret, generation) seals it, moved to ``name``."""
    other = SealedStore(HashStore(), secret, generation)
    inner = HashStore()
    other._inner = inner
    other.set("addr", b"127.0.0.1:6666")
    return bytes(inner.get(other.name("addr")))


def test_counters_are_sealed_and_add_up() -> None:
    shared = HashStore()
    a, b = SealedStore(shared, SECRET, 0), SealedStore(shared, SECRET, 0)

    assert a.add("n", 2) == 2 and b.add("n", 3) == 5
    shared.set(a.name("n"), b"1000")  # a forged counter

    with pytest.raises(RendezvousTampered):
        a.add("n", 1)


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="rendezvous_secret: at least 32 hex digits"):
        SealedStore(HashStore(), "ab" * 8, 0)


def test_gloo_interface_of_loopback_and_of_a_foreign_address() -> None:
    assert gloo_interface("127.0.0.1") == "lo"
    with pytest.raises(OSError, match="not an address of any interface"):
        gloo_interface("198.51.100.7")  # TEST-NET-2: on no interface here
