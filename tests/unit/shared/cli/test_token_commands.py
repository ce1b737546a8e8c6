"""``neuroshard token keygen|create|revoke`` and how a daemon loads its keys (daemons hold no
token of their own: they are known by their certificates)."""

from __future__ import annotations

import os
from pathlib import Path

import jwt
import pytest

from shared.cli.main import main
from shared.config import AuthConfig, ConfigError, TlsConfig, WorkerConfig, load_config
from shared.security.certs import CertPaths, write_dev_certs
from shared.security.tokens import (
    AUD_COORDINATOR,
    RevocationList,
    TokenError,
    create_token,
    read_private_key,
    read_public_key,
    token_id,
    verify_token,
    write_keypair,
)
from shared.security.transport import DaemonSecurity


def test_keygen_then_create_prints_a_token_the_public_key_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Act
    assert main(["token", "keygen", str(tmp_path / "keys")]) == 0
    code = main(
        [
            "token",
            "create",
            "--role",
            "writer",
            "--subject",
            "ci-pipeline",
            "--ttl",
            "7d",
            "--private-key-file",
            str(tmp_path / "keys" / "private.pem"),
        ]
    )

    # Assert
    assert code == 0
    token = capsys.readouterr().out.strip()
    p = verify_token(read_public_key(tmp_path / "keys" / "public.pem"), token)
    assert (p.subject, p.role, p.audience) == ("ci-pipeline", "writer", AUD_COORDINATOR)
    assert (
        p.token_id
        and p.expires_at - jwt.decode(token, options={"verify_signature": False})["iat"]
        == 7 * 86400
    )
    assert os.stat(tmp_path / "keys" / "private.pem").st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--role", "reader", "--subject", "r", "--ttl", "1w"], "error: --ttl: expected"),
        (["--role", "reader", "--subject", ""], "error: --subject: must not be empty"),
        (
            ["--role", "admin", "--subject", "a", "--ttl", "8d"],
            "error: --ttl: at most 604800 s for a admin token, got 691200 s",
        ),
        (
            ["--role", "writer", "--subject", "w", "--ttl", "31d"],
            "error: --ttl: at most 2592000 s for a writer token, got 2678400 s",
        ),
    ],
)
def test_create_refuses_bad_arguments_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    private, _ = write_keypair(tmp_path)
    code = main(["token", "create", *args, "--private-key-file", str(private)])
    err = capsys.readouterr()
    assert code == 2 and err.out == ""
    assert err.err.startswith(message) and err.err.count("\n") == 1


@pytest.mark.parametrize(
    "args",
    [
        ["--role", "worker", "--subject", "w0"],  # daemons are known by certificates
        ["--role", "coordinator", "--subject", "coordinator"],
        ["--role", "reader", "--subject", "r", "--names", "x-*"],  # name patterns are gone
    ],
)
def test_create_makes_no_daemon_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    private, _ = write_keypair(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["token", "create", *args, "--private-key-file", str(private)])
    out = capsys.readouterr()
    assert info.value.code == 2 and out.out == ""
    assert "invalid choice" in out.err or "unrecognized arguments: --names" in out.err


def test_create_names_a_missing_key_file_and_keygen_keeps_an_existing_pair(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.pem"
    code = main(
        ["token", "create", "--role", "admin", "--subject", "a"]
        + [
            "--private-key-file",
            str(missing),
        ]
    )
    assert code == 2
    assert capsys.readouterr().err.startswith(f"error: --private-key-file {missing}: No such")
    private, _ = write_keypair(tmp_path / "k")
    before = private.read_bytes()
    assert main(["token", "keygen", str(tmp_path / "k")]) == 2
    assert "holds a private key already" in capsys.readouterr().err
    assert private.read_bytes() == before


def test_revoke_by_token_or_id_appends_to_the_list_daemons_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Arrange: two tokens, and a list that daemons check on every call
    private, public = write_keypair(tmp_path / "keys")
    key, pub = read_private_key(private), read_public_key(public)
    first, second = (create_token(key, "admin", s, 3600) for s in ("a", "b"))
    listed = tmp_path / "lists" / "revoked"
    listed.parent.mkdir()
    revoked = RevocationList(listed, check_interval_s=0.0)
    assert verify_token(pub, first, revoked=revoked).subject == "a"

    # Act: one revoked by the token itself, one by its id
    assert main(["token", "revoke", first, "--file", str(listed)]) == 0
    assert capsys.readouterr().err == f"revoked {token_id(first)} (in {listed})\n"
    assert main(["token", "revoke", f" {token_id(second)}\n", "--file", str(listed)]) == 0

    # Assert: both ids in the file, one per line, and both tokens refused
    assert listed.read_text() == f"{token_id(first)}\n{token_id(second)}\n"
    for token in (first, second):
        with pytest.raises(TokenError, match=r"^token [0-9a-f]{32} is revoked$"):
            verify_token(pub, token, revoked=revoked)
    third = create_token(key, "admin", "c", 3600)
    assert verify_token(pub, third, revoked=revoked).subject == "c"  # others still pass


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("a.b.c", "error: TOKEN: token is malformed"),
        ("two words", "error: TOKEN: not a token or a token id: 'two words'"),
        ("id#comment", "error: TOKEN: not a token or a token id"),
        ("   ", "error: TOKEN: not a token or a token id"),
    ],
)
def test_revoke_refuses_what_is_no_token_or_id(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, message: str
) -> None:
    listed = tmp_path / "revoked"
    assert main(["token", "revoke", value, "--file", str(listed)]) == 2
    assert capsys.readouterr().err.startswith(message)
    assert not listed.exists()


def test_revoke_a_token_without_an_id(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    private, _ = write_keypair(tmp_path)
    no_jti = jwt.encode({"sub": "x", "role": "admin"}, read_private_key(private), algorithm="EdDSA")
    assert main(["token", "revoke", no_jti, "--file", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err.startswith("error: TOKEN: token has no 'jti' claim")


def test_revoke_names_a_file_it_cannot_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "missing-dir" / "revoked"
    assert main(["token", "revoke", "abc123", "--file", str(target)]) == 2
    assert capsys.readouterr().err.startswith(f"error: --file: {target}: No such file")


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    return write_dev_certs(tmp_path_factory.mktemp("certs"), workers=["w0"])


def _coordinator_tls(certs: CertPaths) -> TlsConfig:
    return TlsConfig(
        ca_file=str(certs.ca_cert),
        cert_file=str(certs.coordinator_cert),
        key_file=str(certs.coordinator_key),
    )


def test_the_coordinator_holds_the_signing_key_and_sends_no_token(
    tmp_path: Path, certs: CertPaths
) -> None:
    private, public = write_keypair(tmp_path)
    auth = AuthConfig(public_key_file=str(public), private_key_file=str(private))

    sec = DaemonSecurity.from_config(_coordinator_tls(certs), auth, "coordinator", coordinator=True)

    assert sec.channel.token is None and sec.auth == "token"  # its certificate names it
    assert sec.public_key is not None  # the token check is on
    mint = sec.data_token_minter(600)
    assert mint is not None


def test_a_worker_must_not_hold_the_private_key(tmp_path: Path, certs: CertPaths) -> None:
    private, public = write_keypair(tmp_path)
    cert, key = certs.worker("w0")
    tls = TlsConfig(ca_file=str(certs.ca_cert), cert_file=str(cert), key_file=str(key))
    auth = AuthConfig(public_key_file=str(public), private_key_file=str(private))
    with pytest.raises(ConfigError, match="^auth.private_key_file: a worker must not hold"):
        DaemonSecurity.from_config(tls, auth, "w0")


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            {"auth": {"public_key_file": "p", "token_file": "/etc/neuroshard/worker.token"}},
            "token_file: daemons present no tokens",
        ),
        (
            {"tls": {"ca_file": "a", "cert_file": "b", "key_file": "c", "server_name": "x"}},
            "server_name: no longer supported",
        ),
    ],
)
def test_a_daemon_config_with_a_token_or_a_shared_name_is_refused(
    tmp_path: Path, section: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(WorkerConfig, None, name="w0", coordinator="localhost:1", **section)


@pytest.mark.parametrize(
    "case", ["no private key", "another pair", "public key missing", "private key is no key"]
)
def test_coordinator_key_problems_name_the_field(
    tmp_path: Path, certs: CertPaths, case: str
) -> None:
    # Arrange
    private, public = write_keypair(tmp_path / "ours")
    other, _ = write_keypair(tmp_path / "theirs")
    missing = tmp_path / "x.pem"
    auth, message = {
        "no private key": (
            AuthConfig(public_key_file=str(public)),
            "auth.private_key_file: required on the coordinator",
        ),
        "another pair": (
            AuthConfig(public_key_file=str(public), private_key_file=str(other)),
            f"auth.private_key_file: {other} is not the private key of",
        ),
        "public key missing": (
            AuthConfig(public_key_file=str(missing), private_key_file=str(private)),
            f"auth.public_key_file {missing}: No such file",
        ),
        "private key is no key": (
            AuthConfig(public_key_file=str(public), private_key_file=str(public)),
            f"auth.private_key_file {public}: is not an unencrypted",
        ),
    }[case]

    # Act / Assert
    with pytest.raises(ConfigError) as info:
        DaemonSecurity.from_config(_coordinator_tls(certs), auth, "coordinator", coordinator=True)
    assert str(info.value).startswith(message)
