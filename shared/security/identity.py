"""Daemon identities carried by TLS certificates (SPIFFE-style URIs in the SAN).

Daemons prove who they are by the certificate they present in mutual TLS, never by a bearer
token (see docs/architecture.md, "Trust boundaries"). A daemon certificate, signed by the
cluster's CA, carries exactly one identity URI among its subject alternative names:

- ``spiffe://neuroshard/coordinator``: the coordinator;
- ``spiffe://neuroshard/worker/NAME``: worker ``NAME`` (the name it registers);

plus the DNS names and IP addresses it is dialled by. A certificate without such a URI is a
person's or a program's (``client.crt``): it opens the TLS connection, and its calls are
authorised by their bearer token alone.

The server reads the peer's certificate from ``context.auth_context()["x509_pem_cert"]``
(gRPC core puts the verified leaf there) and parses it with ``cryptography``; the parse is
cached per certificate, so a connection's thousands of calls cost one parse.

The URI form follows the SPIFFE ID of the SPIFFE standard (``spiffe://trust-domain/path``),
which cert-manager's csi-driver and SPIRE issue.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import re
from dataclasses import dataclass
from typing import Any

from cryptography import x509

TRUST_DOMAIN = "neuroshard"
COORDINATOR = "coordinator"
WORKER = "worker"
_PREFIX = f"spiffe://{TRUST_DOMAIN}/"
# A worker name as the config accepts it (letters, digits, '.', '_', '-'); checked here too so
# that a URI with a path separator or an empty name is no identity at all.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CACHE_SIZE = 256


@dataclass(frozen=True)
class PeerIdentity:
    """Who a daemon certificate says its holder is.

    Attributes:
        kind: ``coordinator`` or ``worker``.
        name: the worker's name; ``coordinator`` for the coordinator.
        hosts: the certificate's DNS names (wildcards as written) and IP addresses, the
            hosts its holder may be dialled at.
    """

    kind: str
    name: str
    hosts: tuple[str, ...] = ()

    def covers_host(self, host: str) -> bool:
        """Tell whether ``host`` (a DNS name or an IP address) is among the certificate's names.

        DNS names compare case-insensitively, and a wildcard matches one label only (as TLS
        hostname verification does, RFC 6125 6.4.3); IP addresses compare as addresses.
        """
        host = host.strip("[]").lower()
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        for name in self.hosts:
            if ip is not None:
                try:
                    if ipaddress.ip_address(name) == ip:
                        return True
                except ValueError:
                    continue
            elif _dns_match(name.lower(), host):
                return True
        return False


def _dns_match(pattern: str, host: str) -> bool:
    """Match ``host`` against a DNS SAN; ``*`` stands for exactly one whole leftmost label."""
    if not pattern.startswith("*."):
        return pattern == host
    head, _, rest = host.partition(".")
    return bool(head) and rest == pattern[2:] and fnmatch.fnmatchcase(head, "*")


def identity_uri(kind: str, name: str = "") -> str:
    """Return a daemon's identity URI: ``spiffe://neuroshard/coordinator``, ``.../worker/NAME``.

    Raises:
        ValueError: an unknown kind, or a worker name that is not a valid name.
    """
    if kind == COORDINATOR:
        return _PREFIX + COORDINATOR
    if kind == WORKER and _NAME.match(name):
        return f"{_PREFIX}{WORKER}/{name}"
    raise ValueError(f"no daemon identity for kind {kind!r} and name {name!r}")


def _parse_uri(uri: str) -> tuple[str, str] | None:
    """``(kind, name)`` of an identity URI, or None for any other URI."""
    if not uri.startswith(_PREFIX):
        return None
    path = uri[len(_PREFIX) :]
    if path == COORDINATOR:
        return COORDINATOR, COORDINATOR
    kind, _, name = path.partition("/")
    if kind == WORKER and _NAME.match(name):
        return WORKER, name
    return None


def identity_of(cert: x509.Certificate) -> PeerIdentity | None:
    """Read the daemon identity of a certificate, or None for a person's or program's.

    A certificate with two identity URIs is no daemon's (it could stand for either).
    """
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    found = [p for p in map(_parse_uri, uris) if p]
    if len(found) != 1:
        return None
    hosts = [*san.get_values_for_type(x509.DNSName)]
    hosts += [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    kind, name = found[0]
    return PeerIdentity(kind, name, tuple(hosts))


def identity_of_pem(pem: bytes) -> PeerIdentity | None:
    """``identity_of`` the first certificate of PEM bytes (None when they do not parse)."""
    try:
        return identity_of(x509.load_pem_x509_certificate(pem))
    except ValueError:
        return None


class PeerIdentities:
    """The daemon identity of an RPC's peer, from its TLS auth context, with a parse cache."""

    def __init__(self, cache_size: int = _CACHE_SIZE) -> None:
        """Remember up to ``cache_size`` parsed certificates (cleared when full)."""
        self._cache: dict[bytes, PeerIdentity | None] = {}
        self._cache_size = cache_size

    def of_context(self, context: Any) -> PeerIdentity | None:
        """Return the identity in the peer's certificate, or None (no TLS, no daemon identity).

        Args:
            context: the RPC's ``grpc.aio.ServicerContext``.
        """
        pems = context.auth_context().get("x509_pem_cert")
        if not pems:
            return None
        pem = pems[0]
        if pem in self._cache:
            return self._cache[pem]
        identity = identity_of_pem(pem)
        if len(self._cache) >= self._cache_size:
            self._cache.clear()
        self._cache[pem] = identity
        return identity
