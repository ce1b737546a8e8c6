"""Development certificates for mutual TLS (``neuroshard certs DIR --hosts NAME,...``).

Writes, with the ``cryptography`` library (ECDSA P-256 keys, SHA-256 signatures):

- ``ca.crt``, ``ca.key``: a self-signed CA (10 years);
- ``node.crt``, ``node.key``: one certificate for every daemon, valid for server and client
  authentication, with the given hosts plus ``localhost`` and ``127.0.0.1`` as subject
  alternative names (wildcards such as ``*.neuroshard-worker`` allowed);
- ``client.crt``, ``client.key``: a client-only certificate for the CLI and scripts.

Private keys are written with mode 0600. Meant for development and tests; production
deployments bring certificates from their own CA (cert-manager, Vault, ...).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_HOSTS = ("localhost", "127.0.0.1")
_DAY = dt.timedelta(days=1)


@dataclass(frozen=True)
class CertPaths:
    """Where ``write_dev_certs`` put the files (all PEM; keys PKCS#8, mode 0600)."""

    ca_cert: Path
    ca_key: Path
    node_cert: Path
    node_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    """A subject or issuer name in the ``neuroshard development`` organisation."""
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "neuroshard development"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    """Subject alternative names: IP addresses as such, anything else as a DNS name."""
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):  # dedupe, keep order
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey, days: int
) -> x509.CertificateBuilder:
    """A builder valid from a day ago (clock skew) for ``days`` days, with a random serial."""
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _DAY)  # tolerate clock skew between hosts
        .not_valid_after(now + days * _DAY)
    )


def make_ca(days: int = 3650) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Make a self-signed CA that may sign leaf certificates only (path length 0).

    Args:
        days: validity, days (default 10 years).

    Returns:
        The CA certificate and its ECDSA P-256 key.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("neuroshard development CA")
    cert = (
        _builder(name, name, key, days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def issue(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    common_name: str,
    hosts: Iterable[str] = (),
    server: bool = True,
    days: int = 825,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Sign a leaf certificate with the CA, usable for client authentication.

    Args:
        ca_cert: the issuing CA's certificate.
        ca_key: the issuing CA's key.
        common_name: the subject's CN (for people; TLS checks the alternative names).
        hosts: DNS names (wildcards allowed) and IP addresses the certificate is valid
            for as a server; none for a client-only certificate.
        server: also allow server authentication.
        days: validity, days (default 825, the most browsers accept).

    Returns:
        The certificate and its new ECDSA P-256 key.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
    if server:
        usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
    builder = (
        _builder(_name(common_name), ca_cert.subject, key, days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
    )
    hosts = list(hosts)
    if hosts:
        builder = builder.add_extension(_san(hosts), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Write ``data`` to ``path``; a private key is created with mode 0600 from the start."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _pem(cert: x509.Certificate) -> bytes:
    """``cert`` as PEM."""
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """``key`` as unencrypted PKCS#8 PEM."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def write_dev_certs(directory: str | Path, hosts: Iterable[str] = ()) -> CertPaths:
    """Create a CA, a node certificate and a client certificate under ``directory``.

    The directory is created if needed; existing files are replaced (tokens are not
    affected: they are signed with the token key pair, not with these).

    Args:
        directory: where to write the six files.
        hosts: the node certificate's host names and IPs besides localhost and 127.0.0.1
            (blank entries are skipped).

    Returns:
        The paths written.

    Raises:
        OSError: the directory cannot be written.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    paths = CertPaths(
        d / "ca.crt",
        d / "ca.key",
        d / "node.crt",
        d / "node.key",
        d / "client.crt",
        d / "client.key",
    )
    ca_cert, ca_key = make_ca()
    node_hosts = [h.strip() for h in hosts if h.strip()] + list(DEFAULT_HOSTS)
    node_cert, node_key = issue(ca_cert, ca_key, "neuroshard node", node_hosts, server=True)
    client_cert, client_key = issue(ca_cert, ca_key, "neuroshard client", server=False)
    _write(paths.ca_cert, _pem(ca_cert))
    _write(paths.ca_key, _key_pem(ca_key), private=True)
    _write(paths.node_cert, _pem(node_cert))
    _write(paths.node_key, _key_pem(node_key), private=True)
    _write(paths.client_cert, _pem(client_cert))
    _write(paths.client_key, _key_pem(client_key), private=True)
    return paths
