"""Development certificates and the checks ``TlsFiles.load`` makes before a daemon starts."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from shared.config import ConfigError
from shared.security.certs import write_dev_certs
from shared.security.transport import TlsFiles, client_security


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory):
    return write_dev_certs(
        tmp_path_factory.mktemp("certs"), ["coord.example", "10.1.2.3", "*.workers.example"]
    )


def _load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_the_ca_signs_the_node_and_client_certificates(certs) -> None:
    ca = _load(certs.ca_cert)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for leaf in (_load(certs.node_cert), _load(certs.client_cert)):
        assert leaf.issuer == ca.subject
        leaf.verify_directly_issued_by(ca)  # raises when the signature does not verify


def test_the_node_certificate_names_the_hosts_for_server_and_client_auth(certs) -> None:
    node = _load(certs.node_cert)
    san = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [
        "coord.example",
        "*.workers.example",
        "localhost",
    ]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.1.2.3"),
        ipaddress.ip_address("127.0.0.1"),
    ]
    usages = node.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}


def test_the_client_certificate_is_for_client_auth_only(certs) -> None:
    usages = _load(certs.client_cert).extensions.get_extension_for_class(x509.ExtendedKeyUsage)
    assert list(usages.value) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert isinstance(_load(certs.client_cert).public_key(), ec.EllipticCurvePublicKey)


def test_private_keys_are_readable_by_the_owner_only(certs) -> None:
    for key in (certs.ca_key, certs.node_key, certs.client_key):
        assert os.stat(key).st_mode & 0o777 == 0o600
    assert os.stat(certs.ca_cert).st_mode & 0o777 == 0o644


def test_tls_files_load_checks_each_file_naming_the_field(certs, tmp_path: Path) -> None:
    ok = TlsFiles.load(str(certs.ca_cert), str(certs.node_cert), str(certs.node_key))
    assert ok.ca.startswith(b"-----BEGIN CERTIFICATE-----")
    cases = [
        ((tmp_path / "nope", certs.node_cert, certs.node_key), "tls.ca_file: "),
        ((certs.ca_cert, certs.ca_key, certs.node_key), "tls.cert_file: "),
        ((certs.ca_cert, certs.node_cert, certs.node_cert), "tls.key_file: "),
        ((certs.ca_cert, certs.node_cert, certs.client_key), "is not the key of"),
    ]
    for paths, message in cases:
        with pytest.raises(ConfigError, match=message):
            TlsFiles.load(*map(str, paths))


def test_client_security_needs_all_three_tls_files(certs) -> None:
    with pytest.raises(ConfigError, match="give all three or none"):
        client_security(str(certs.ca_cert), str(certs.client_cert))
    with pytest.raises(ConfigError, match="--tls-key: "):
        client_security(str(certs.ca_cert), str(certs.client_cert), "/nonexistent")
    secured = client_security(
        str(certs.ca_cert), str(certs.client_cert), str(certs.client_key), token="abc"
    )
    assert secured.tls is not None and secured.token is not None and secured.token() == "abc"
