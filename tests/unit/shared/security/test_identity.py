"""Daemon identities in certificates: the SPIFFE-style URI, host coverage, the peer's identity
from the TLS auth context."""

from __future__ import annotations

import datetime as dt
import ipaddress

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from shared.security.identity import (
    PeerIdentities,
    PeerIdentity,
    identity_of,
    identity_of_pem,
    identity_uri,
)

KEY = ec.generate_private_key(ec.SECP256R1())


def _cert(uris: list[str] | None, dns: tuple[str, ...] = (), ips: tuple[str, ...] = ()):
    """A self-signed certificate with these alternative names (None: no SAN extension)."""
    now = dt.datetime.now(dt.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "worker-0")])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(KEY.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=1))
    )
    if uris is not None:
        names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(u) for u in uris]
        names += [x509.DNSName(d) for d in dns]
        names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(KEY, hashes.SHA256())


def test_the_coordinator_identity() -> None:
    cert = _cert(["spiffe://neuroshard/coordinator"], ("coord.example", "localhost"), ("10.0.0.1",))
    assert identity_of(cert) == PeerIdentity(
        "coordinator", "coordinator", ("coord.example", "localhost", "10.0.0.1")
    )


def test_a_worker_identity() -> None:
    cert = _cert(["spiffe://neuroshard/worker/worker-0"], ("w0.example",), ("127.0.0.1",))
    assert identity_of(cert) == PeerIdentity("worker", "worker-0", ("w0.example", "127.0.0.1"))


@pytest.mark.parametrize(
    "uris",
    [
        None,  # no alternative names at all
        [],  # only DNS names: a person's or program's certificate
        ["spiffe://other-domain/worker/w0"],
        ["https://neuroshard/worker/w0"],
        ["spiffe://neuroshard/worker/"],
        ["spiffe://neuroshard/worker/a/b"],
        ["spiffe://neuroshard/worker/../coordinator"],
        ["spiffe://neuroshard/worker/-x"],
        ["spiffe://neuroshard/admin"],
        ["spiffe://neuroshard/coordinator/x"],
        ["spiffe://neuroshard/Coordinator"],
        ["spiffe://neuroshard/worker/w0", "spiffe://neuroshard/worker/w1"],  # which one?
        ["spiffe://neuroshard/worker/w0", "spiffe://neuroshard/coordinator"],
    ],
    ids=[
        "no san",
        "dns only",
        "other trust domain",
        "other scheme",
        "empty name",
        "path in name",
        "dot-dot",
        "leading dash",
        "unknown kind",
        "coordinator with a path",
        "case",
        "two workers",
        "worker and coordinator",
    ],
)
def test_no_identity(uris: list[str] | None) -> None:
    assert identity_of(_cert(uris, ("localhost",))) is None


def test_other_uris_beside_the_identity_are_ignored() -> None:
    cert = _cert(["https://example.org/", "spiffe://neuroshard/worker/w0", "spiffe://x/y"])
    identity = identity_of(cert)
    assert identity is not None and (identity.kind, identity.name) == ("worker", "w0")


def test_identity_uri() -> None:
    assert identity_uri("coordinator") == "spiffe://neuroshard/coordinator"
    assert identity_uri("worker", "w-0.a_b") == "spiffe://neuroshard/worker/w-0.a_b"
    for kind, name in [("worker", ""), ("worker", "a/b"), ("admin", "x"), ("worker", "x" * 129)]:
        with pytest.raises(ValueError, match="no daemon identity"):
            identity_uri(kind, name)


def test_identity_of_pem() -> None:
    cert = _cert(["spiffe://neuroshard/worker/w0"])
    pem = cert.public_bytes(serialization.Encoding.PEM)
    identity = identity_of_pem(pem)
    assert identity is not None and identity.name == "w0"
    assert identity_of_pem(b"not a certificate") is None


@pytest.mark.parametrize(
    ("hosts", "host", "covered"),
    [
        (("w0.example",), "w0.example", True),
        (("w0.example",), "W0.Example", True),  # DNS names compare case-insensitively
        (("W0.EXAMPLE",), "w0.example", True),
        (("w0.example",), "w1.example", False),
        (("w0.example",), "w0.example.evil", False),
        (("w0.example",), "x.w0.example", False),
        (("*.workers.svc",), "w0.workers.svc", True),
        (("*.workers.svc",), "W0.WORKERS.SVC", True),
        (("*.workers.svc",), "a.b.workers.svc", False),  # a wildcard is one label only
        (("*.workers.svc",), "workers.svc", False),
        (("*.workers.svc",), ".workers.svc", False),  # an empty label is no label
        (("*.workers.svc",), "w0.workers.svc.evil", False),
        (("127.0.0.1",), "127.0.0.1", True),
        (("127.0.0.1",), "127.0.0.2", False),
        (("127.0.0.1",), "localhost", False),  # no resolution
        (("localhost",), "127.0.0.1", False),
        (("::1",), "::1", True),
        (("::1",), "[::1]", True),  # as a host:port address writes it
        (("::1",), "0:0:0:0:0:0:0:1", True),  # compared as addresses
        (("::1",), "127.0.0.1", False),
        (("10.0.0.1",), "10.0.0.01", False),  # not an address: compared as a name
        (("*.1.0.10",), "10.0.0.1", False),  # wildcards never match an address
        ((), "localhost", False),
    ],
)
def test_covers_host(hosts: tuple[str, ...], host: str, covered: bool) -> None:
    assert PeerIdentity("worker", "w0", hosts).covers_host(host) is covered


class _Context:
    def __init__(self, pems: list[bytes] | None) -> None:
        self.calls = 0
        self._pems = pems

    def auth_context(self) -> dict[str, list[bytes]]:
        self.calls += 1
        return {} if self._pems is None else {"x509_pem_cert": self._pems}


def test_peer_identity_from_the_auth_context_is_parsed_once(monkeypatch) -> None:
    # Arrange
    from shared.security import identity as module

    pem = _cert(["spiffe://neuroshard/worker/w0"]).public_bytes(serialization.Encoding.PEM)
    parsed: list[bytes] = []
    real = module.identity_of_pem
    monkeypatch.setattr(module, "identity_of_pem", lambda p: parsed.append(p) or real(p))
    peers = PeerIdentities(cache_size=2)

    # Act / Assert: the same certificate is parsed once, over many calls
    for _ in range(5):
        identity = peers.of_context(_Context([pem]))
        assert identity is not None and identity.name == "w0"
    assert parsed == [pem]
    assert peers.of_context(_Context(None)) is None  # plaintext: no certificate
    assert peers.of_context(_Context([])) is None


def test_the_parse_cache_is_bounded() -> None:
    peers = PeerIdentities(cache_size=2)
    pems = [
        _cert([f"spiffe://neuroshard/worker/w{i}"]).public_bytes(serialization.Encoding.PEM)
        for i in range(5)
    ]
    for i, pem in enumerate(pems):
        identity = peers.of_context(_Context([pem]))
        assert identity is not None and identity.name == f"w{i}"
        assert len(peers._cache) <= 2
    no_identity = _cert([]).public_bytes(serialization.Encoding.PEM)
    assert peers.of_context(_Context([no_identity])) is None
    assert peers.of_context(_Context([no_identity])) is None  # a cached None is still None
