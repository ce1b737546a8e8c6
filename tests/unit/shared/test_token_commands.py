"""``neuroshard token keygen|create`` and how a daemon loads its keys and its own token."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.cli.main import main
from shared.config import AuthConfig, ConfigError
from shared.security.tokens import read_public_key, verify_token, write_keypair
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
            "worker",
            "--subject",
            "neuroshard-worker",
            "--names",
            "neuroshard-worker-*",
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
    assert (p.subject, p.role, p.names) == ("neuroshard-worker", "worker", "neuroshard-worker-*")
    assert os.stat(tmp_path / "keys" / "private.pem").st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--role", "reader", "--subject", "r", "--names", "x-*"], "error: --names: a non-empty"),
        (["--role", "reader", "--subject", "r", "--ttl", "1w"], "error: --ttl: expected"),
        (["--role", "reader", "--subject", ""], "error: --subject: must not be empty"),
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


def test_the_coordinator_signs_its_own_admin_token(tmp_path: Path) -> None:
    private, public = write_keypair(tmp_path)
    auth = AuthConfig(public_key_file=str(public), private_key_file=str(private))

    sec = DaemonSecurity.from_config(None, auth, "coordinator", coordinator=True)

    assert sec.channel.token is not None and sec.auth == "token"
    p = verify_token(read_public_key(public), sec.channel.token())
    assert (p.subject, p.role) == ("coordinator", "admin")
    assert sec.public_key is not None  # the token check is on


@pytest.mark.parametrize(
    "case", ["no private key", "another pair", "public key missing", "private key is no key"]
)
def test_coordinator_key_problems_name_the_field(tmp_path: Path, case: str) -> None:
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
        DaemonSecurity.from_config(None, auth, "coordinator", coordinator=True)
    assert str(info.value).startswith(message)
