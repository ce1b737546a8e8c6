"""Development certificates (CA, coordinator, workers, client), ``neuroshard certs``, and the
checks ``TlsFiles.load`` and ``DaemonSecurity`` make before a daemon starts."""

from __future__ import annotations

import argparse
import ipaddress
import os
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from shared.cli.security import cmd_certs
from shared.config import AuthConfig, ConfigError, TlsConfig
from shared.security.certs import CertPaths, issue_worker, write_dev_certs
from shared.security.identity import identity_of
from shared.security.tokens import write_keypair
from shared.security.transport import DaemonSecurity, TlsFiles, client_security

HOSTS = ["coord.example", "10.1.2.3", "*.workers.example"]


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    return write_dev_certs(tmp_path_factory.mktemp("certs"), HOSTS, ["w0", "w1"])


def _load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _san(cert: x509.Certificate) -> x509.SubjectAlternativeName:
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def test_the_ca_signs_every_certificate(certs: CertPaths) -> None:
    ca = _load(certs.ca_cert)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    leaves = [certs.coordinator_cert, certs.client_cert, certs.worker("w0")[0]]
    for leaf in map(_load, [*leaves, certs.worker("w1")[0]]):
        assert leaf.issuer == ca.subject
        leaf.verify_directly_issued_by(ca)  # raises when the signature does not verify


def test_the_coordinator_certificate_names_it_and_the_hosts(certs: CertPaths) -> None:
    cert = _load(certs.coordinator_cert)
    san = _san(cert)
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://neuroshard/coordinator"
    ]
    assert san.get_values_for_type(x509.DNSName) == [
        "coord.example",
        "*.workers.example",
        "localhost",
    ]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.1.2.3"),
        ipaddress.ip_address("127.0.0.1"),
    ]
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    identity = identity_of(cert)
    assert identity is not None and (identity.kind, identity.name) == ("coordinator", "coordinator")


@pytest.mark.parametrize("name", ["w0", "w1"])
def test_each_worker_has_its_own_certificate_naming_it(certs: CertPaths, name: str) -> None:
    cert_path, key_path = certs.worker(name)
    assert cert_path == certs.ca_cert.parent / "workers" / f"{name}.crt"
    cert = _load(cert_path)
    assert _san(cert).get_values_for_type(x509.UniformResourceIdentifier) == [
        f"spiffe://neuroshard/worker/{name}"
    ]
    identity = identity_of(cert)
    assert identity is not None and (identity.kind, identity.name) == ("worker", name)
    assert identity.covers_host("127.0.0.1") and identity.covers_host("w7.workers.example")
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    TlsFiles.load(str(certs.ca_cert), str(cert_path), str(key_path))  # key matches
    assert _load(certs.worker("w0")[0]).public_key() != _load(certs.worker("w1")[0]).public_key()


def test_the_client_certificate_is_for_client_auth_only_and_names_no_daemon(
    certs: CertPaths,
) -> None:
    cert = _load(certs.client_cert)
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage)
    assert list(usages.value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert identity_of(cert) is None  # a person's calls are authorised by their token


def test_private_keys_are_readable_by_the_owner_only(certs: CertPaths) -> None:
    keys = (certs.ca_key, certs.coordinator_key, certs.client_key, certs.worker("w0")[1])
    for key in keys:
        assert os.stat(key).st_mode & 0o777 == 0o600
    assert os.stat(certs.ca_cert).st_mode & 0o777 == 0o644
    assert os.stat(certs.worker("w0")[0].parent).st_mode & 0o777 == 0o700


def test_issue_worker_adds_a_worker_from_the_same_ca(tmp_path: Path) -> None:
    # Arrange
    paths = write_dev_certs(tmp_path, ["coord.example"])
    assert not (tmp_path / "workers").exists()

    # Act
    cert_path, key_path = issue_worker(paths, "late", ["late.example"])

    # Assert
    cert = _load(cert_path)
    cert.verify_directly_issued_by(_load(paths.ca_cert))
    identity = identity_of(cert)
    assert identity is not None and identity.name == "late"
    assert identity.hosts == ("late.example", "localhost", "127.0.0.1")
    assert os.stat(key_path).st_mode & 0o777 == 0o600


@pytest.mark.parametrize("name", ["", "a/b", "../x", "-w", "w 0", "w0/../coordinator"])
def test_issue_worker_refuses_a_name_that_is_no_worker_name(tmp_path: Path, name: str) -> None:
    paths = write_dev_certs(tmp_path)
    with pytest.raises(ValueError, match="no daemon identity"):
        issue_worker(paths, name)
    assert not list((tmp_path).glob("workers/*"))


def _certs_args(directory: Path, **kw: object) -> argparse.Namespace:
    return argparse.Namespace(
        **{"dir": str(directory), "hosts": "", "workers": "", "add_worker": None, **kw}
    )


def test_certs_command_writes_the_named_workers_and_adds_one_later(tmp_path: Path, capsys) -> None:
    # Act
    assert cmd_certs(_certs_args(tmp_path, hosts="h.example,", workers="w0, w1")) == 0
    first = capsys.readouterr().out
    assert cmd_certs(_certs_args(tmp_path, hosts="h.example", add_worker="w2")) == 0
    added = capsys.readouterr().out

    # Assert
    paths = CertPaths.under(tmp_path)
    assert f"coordinator: {paths.coordinator_cert}" in first
    assert f"worker w0: {paths.worker('w0')[0]}" in first and "hosts: h.example, localhost" in first
    assert added.startswith(f"worker w2: {paths.worker('w2')[0]}")
    ca = _load(paths.ca_cert)
    for name in ("w0", "w1", "w2"):
        cert = _load(paths.worker(name)[0])
        cert.verify_directly_issued_by(ca)  # --add-worker used the CA already there
        identity = identity_of(cert)
        assert identity is not None and identity.name == name
        assert identity.covers_host("h.example")


def test_certs_command_refuses_bad_names_and_a_missing_ca(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="^--workers: no daemon identity"):
        cmd_certs(_certs_args(tmp_path / "a", workers="ok,a/b"))
    with pytest.raises(ConfigError, match=r"^DIR: .*ca\.crt: no CA here"):
        cmd_certs(_certs_args(tmp_path / "empty", add_worker="w9"))


def test_tls_files_load_checks_each_file_naming_the_field(certs: CertPaths, tmp_path: Path) -> None:
    cert, key = certs.coordinator_cert, certs.coordinator_key
    ok = TlsFiles.load(str(certs.ca_cert), str(cert), str(key))
    assert ok.ca.startswith(b"-----BEGIN CERTIFICATE-----")
    cases = [
        ((tmp_path / "nope", cert, key), "tls.ca_file: "),
        ((certs.ca_cert, certs.ca_key, key), "tls.cert_file: "),
        ((certs.ca_cert, cert, cert), "tls.key_file: "),
        ((certs.ca_cert, cert, certs.client_key), "is not the key of"),
        ((certs.ca_cert, certs.worker("w0")[0], certs.worker("w1")[1]), "is not the key of"),
    ]
    for paths, message in cases:
        with pytest.raises(ConfigError, match=message):
            TlsFiles.load(*map(str, paths))


def _tls(certs: CertPaths, cert: Path, key: Path) -> TlsConfig:
    return TlsConfig(ca_file=str(certs.ca_cert), cert_file=str(cert), key_file=str(key))


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_keypair(tmp_path_factory.mktemp("auth"))


@pytest.mark.parametrize(
    ("which", "subject", "coordinator", "found", "expected"),
    [
        ("client", "w0", False, "no daemon", "worker 'w0'"),
        ("w1", "w0", False, "worker 'w1'", "worker 'w0'"),  # another worker's certificate
        ("coordinator", "w0", False, "coordinator 'coordinator'", "worker 'w0'"),
        ("w0", "coordinator", True, "worker 'w0'", "the coordinator"),
        ("client", "coordinator", True, "no daemon", "the coordinator"),
    ],
)
def test_a_daemon_with_auth_starts_only_with_a_certificate_naming_it(
    certs: CertPaths,
    keys: tuple[Path, Path],
    which: str,
    subject: str,
    coordinator: bool,
    found: str,
    expected: str,
) -> None:
    # Arrange
    cert, key = {
        "client": (certs.client_cert, certs.client_key),
        "coordinator": (certs.coordinator_cert, certs.coordinator_key),
        "w0": certs.worker("w0"),
        "w1": certs.worker("w1"),
    }[which]
    private, public = keys
    auth = AuthConfig(
        public_key_file=str(public), private_key_file=str(private) if coordinator else None
    )

    # Act / Assert
    with pytest.raises(ConfigError) as info:
        DaemonSecurity.from_config(_tls(certs, cert, key), auth, subject, coordinator=coordinator)
    assert str(info.value).startswith(f"tls.cert_file: {cert} names {found}, not {expected}")


def test_daemons_start_with_their_own_certificates(
    certs: CertPaths, keys: tuple[Path, Path]
) -> None:
    private, public = keys
    coordinator = DaemonSecurity.from_config(
        _tls(certs, certs.coordinator_cert, certs.coordinator_key),
        AuthConfig(public_key_file=str(public), private_key_file=str(private)),
        "coordinator",
        coordinator=True,
    )
    assert (coordinator.transport, coordinator.auth) == ("mtls", "token")
    assert coordinator.audience == "neuroshard" and coordinator.signing_key is not None
    assert coordinator.channel.token is None  # no bearer token travels between daemons
    worker = DaemonSecurity.from_config(
        _tls(certs, *certs.worker("w0")), AuthConfig(public_key_file=str(public)), "w0"
    )
    assert worker.audience == "neuroshard-data" and worker.signing_key is None
    assert worker.channel.token is None


def test_auth_without_tls_is_refused(keys: tuple[Path, Path]) -> None:
    _, public = keys
    with pytest.raises(ConfigError, match="^auth: needs tls"):
        DaemonSecurity.from_config(None, AuthConfig(public_key_file=str(public)), "w0")


def test_client_security_needs_all_three_tls_files(certs: CertPaths) -> None:
    with pytest.raises(ConfigError, match="give all three or none"):
        client_security(str(certs.ca_cert), str(certs.client_cert))
    with pytest.raises(ConfigError, match="--tls-key: "):
        client_security(str(certs.ca_cert), str(certs.client_cert), "/nonexistent")
    secured = client_security(
        str(certs.ca_cert), str(certs.client_cert), str(certs.client_key), token="abc"
    )
    assert secured.tls is not None and secured.token is not None and secured.token() == "abc"
