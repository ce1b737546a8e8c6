"""Development certificates for mutual TLS (``neuroshard certs DIR --hosts H,... --workers W,...``).

Writes, with the ``cryptography`` library (ECDSA P-256 keys, SHA-256 signatures):

- ``ca.crt``, ``ca.key``: a self-signed CA (10 years);
- ``coordinator.crt``, ``coordinator.key``: the coordinator's certificate, its identity
  ``spiffe://neuroshard/coordinator`` in the subject alternative names
  (``shared.security.identity``), valid for server and client authentication;
- ``workers/NAME.crt``, ``workers/NAME.key``: one certificate per worker, identity
  ``spiffe://neuroshard/worker/NAME`` (``issue_worker``, also later, from the CA in the
  directory);
- ``client.crt``, ``client.key``: a client-only certificate for the CLI and scripts (no
  identity: a person's calls are authorised by their token).

Daemon certificates name the given hosts plus ``localhost`` and ``127.0.0.1`` (wildcards
such as ``*.neuroshard-worker`` allowed); a worker may register only an address whose host
its certificate names. Private keys are written with mode 0600. Meant for development and
tests; production deployments bring certificates from their own CA (cert-manager, SPIRE).
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

from shared.security.identity import COORDINATOR, WORKER, identity_uri

DEFAULT_HOSTS = ("localhost", "127.0.0.1")
_DAY = dt.timedelta(days=1)


@dataclass(frozen=True)
class CertPaths:
    """Where ``write_dev_certs`` put the files (all PEM; keys PKCS#8, mode 0600)."""

    ca_cert: Path
    ca_key: Path
    coordinator_cert: Path
    coordinator_key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def under(cls, directory: str | Path) -> CertPaths:
        """The paths ``write_dev_certs(directory)`` writes (whether or not they exist)."""
        d = Path(directory)
        return cls(
            d / "ca.crt",
            d / "ca.key",
            d / "coordinator.crt",
            d / "coordinator.key",
            d / "client.crt",
            d / "client.key",
        )

    def worker(self, name: str) -> tuple[Path, Path]:
        """The certificate and key paths of worker ``name`` (``issue_worker`` writes them)."""
        d = self.ca_cert.parent / "workers"
        return d / f"{name}.crt", d / f"{name}.key"


def _name(common_name: str) -> x509.Name:
    """A subject or issuer name in the ``neuroshard development`` organisation."""
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "neuroshard development"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _san(hosts: Iterable[str], uri: str | None = None) -> x509.SubjectAlternativeName:
    """Subject alternative names: the identity ``uri``, IP addresses as such, others as DNS."""
    names: list[x509.GeneralName] = [] if uri is None else [x509.UniformResourceIdentifier(uri)]
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
    uri: str | None = None,
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
        uri: a daemon's identity URI (``identity.identity_uri``), added to the alternative
            names; None for a person's or program's certificate.

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
    if hosts or uri:
        builder = builder.add_extension(_san(hosts, uri), critical=False)
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


def _load_ca(paths: CertPaths) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Read the CA certificate and key ``write_dev_certs`` wrote.

    Raises:
        OSError: a file cannot be read.
        ValueError: a file is not PEM of the right kind, or the key is not an EC key.
    """
    cert = x509.load_pem_x509_certificate(paths.ca_cert.read_bytes())
    key = serialization.load_pem_private_key(paths.ca_key.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{paths.ca_key}: not an EC private key")
    return cert, key


def _hosts(hosts: Iterable[str]) -> list[str]:
    """The non-blank ``hosts`` plus localhost and 127.0.0.1."""
    return [h.strip() for h in hosts if h.strip()] + list(DEFAULT_HOSTS)


def issue_worker(paths: CertPaths, name: str, hosts: Iterable[str] = ()) -> tuple[Path, Path]:
    """Sign a certificate for worker ``name`` with the CA under ``paths``; write it and its key.

    Args:
        paths: a directory ``write_dev_certs`` wrote (its CA signs).
        name: the worker's name (its identity ``spiffe://neuroshard/worker/NAME``).
        hosts: host names and IPs the worker is dialled at, besides localhost and 127.0.0.1.

    Returns:
        The certificate's and the key's paths (``paths.worker(name)``).

    Raises:
        ValueError: ``name`` is not a valid worker name, or the CA files are not valid.
        OSError: the files cannot be read or written.
    """
    uri = identity_uri(WORKER, name)
    ca_cert, ca_key = _load_ca(paths)
    cert, key = issue(ca_cert, ca_key, f"neuroshard worker {name}", _hosts(hosts), uri=uri)
    cert_path, key_path = paths.worker(name)
    cert_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _write(cert_path, _pem(cert))
    _write(key_path, _key_pem(key), private=True)
    return cert_path, key_path


def write_dev_certs(
    directory: str | Path, hosts: Iterable[str] = (), workers: Iterable[str] = ()
) -> CertPaths:
    """Create a CA, the coordinator's, the workers' and a client certificate under ``directory``.

    The directory is created if needed; existing files are replaced (tokens are not
    affected: they are signed with the token key pair, not with these).

    Args:
        directory: where to write the files.
        hosts: the daemon certificates' host names and IPs besides localhost and 127.0.0.1
            (blank entries are skipped).
        workers: names of workers to issue certificates for now (``issue_worker`` adds more
            later).

    Returns:
        The paths written (``CertPaths.worker(name)`` gives a worker's).

    Raises:
        OSError: the directory cannot be written.
        ValueError: a worker name is not valid.
    """
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    paths = CertPaths.under(d)
    ca_cert, ca_key = make_ca()
    coordinator_cert, coordinator_key = issue(
        ca_cert,
        ca_key,
        "neuroshard coordinator",
        _hosts(hosts),
        server=True,
        uri=identity_uri(COORDINATOR),
    )
    client_cert, client_key = issue(ca_cert, ca_key, "neuroshard client", server=False)
    _write(paths.ca_cert, _pem(ca_cert))
    _write(paths.ca_key, _key_pem(ca_key), private=True)
    _write(paths.coordinator_cert, _pem(coordinator_cert))
    _write(paths.coordinator_key, _key_pem(coordinator_key), private=True)
    _write(paths.client_cert, _pem(client_cert))
    _write(paths.client_key, _key_pem(client_key), private=True)
    for name in workers:
        issue_worker(paths, name, hosts)
    return paths
