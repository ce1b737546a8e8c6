"""Bearer tokens: Ed25519 signing, verification and its one-line refusals; keys and TTLs."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import time
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.security.tokens import (
    KeyFileError,
    Principal,
    TokenError,
    TokenSource,
    create_token,
    parse_ttl,
    read_private_key,
    read_public_key,
    verify_token,
    write_keypair,
)

KEY = Ed25519PrivateKey.generate()
PUBLIC = KEY.public_key()
OTHER = Ed25519PrivateKey.generate()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _claims(**extra: object) -> dict[str, object]:
    now = int(time.time())
    return {"sub": "x", "role": "admin", "iss": "neuroshard", "iat": now, "exp": now + 60, **extra}


def _hs256_signed_with(secret: bytes, claims: dict[str, object]) -> str:
    """An HS256 JWT built by hand (PyJWT refuses a PEM key as an HMAC secret, an attacker
    would not): the algorithm-confusion attack signs with the public key's PEM bytes."""
    head = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    body = _b64(json.dumps(claims).encode())
    mac = hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64(mac)}"


def test_a_token_round_trips_subject_role_and_expiry() -> None:
    token = create_token(KEY, "writer", "alice", 60, now=1_000_000)
    assert jwt.get_unverified_header(token)["alg"] == "EdDSA"
    p = verify_token(PUBLIC, token, leeway_s=1e10)
    assert p == Principal("alice", "writer", 1_000_060.0, None)


def test_a_worker_token_carries_a_name_pattern() -> None:
    token = create_token(KEY, "worker", "pool", 60, names="neuroshard-worker-*")
    p = verify_token(PUBLIC, token)
    assert p.names == "neuroshard-worker-*"
    assert p.may_act_as("pool") and p.may_act_as("neuroshard-worker-3")
    assert not p.may_act_as("worker-1") and not p.may_act_as("")
    assert not p.may_act_as("NEUROSHARD-WORKER-3")  # case-sensitive
    plain = verify_token(PUBLIC, create_token(KEY, "worker", "w0", 60))
    assert plain.may_act_as("w0") and not plain.may_act_as("w0-1")


PUBLIC_PEM = PUBLIC.public_bytes(
    serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
)


@pytest.mark.parametrize(
    ("token", "message"),
    [
        (create_token(OTHER, "admin", "eve", 60), "token signature is invalid"),
        (create_token(KEY, "writer", "bob", 10, now=0), "token expired at 1970-01-01T00:00:10Z"),
        ("not.a.jwt", "token is malformed"),
        ("", "token is malformed"),
        (
            jwt.encode(_claims(), None, algorithm="none"),
            "token is signed with alg 'none'; only EdDSA (Ed25519) tokens are accepted",
        ),
        (
            jwt.encode(_claims(), "s" * 32, algorithm="HS256"),
            "token is signed with alg 'HS256'; only EdDSA",
        ),
        (_hs256_signed_with(PUBLIC_PEM, _claims()), "token is signed with alg 'HS256'"),
        (
            jwt.encode(_claims(), ec.generate_private_key(ec.SECP256R1()), algorithm="ES256"),
            "token is signed with alg 'ES256'",
        ),
        (jwt.encode(_claims(role="root"), KEY, algorithm="EdDSA"), "token has unknown role 'root'"),
        (jwt.encode(_claims(role="client"), KEY, algorithm="EdDSA"), "token has unknown role"),
        (
            jwt.encode({k: v for k, v in _claims().items() if k != "role"}, KEY, algorithm="EdDSA"),
            "token lacks the 'role' claim",
        ),
        (jwt.encode(_claims(iss="other"), KEY, algorithm="EdDSA"), "token was not issued by"),
        (
            jwt.encode(_claims(names="*"), KEY, algorithm="EdDSA"),
            "token has a 'names' claim, which only worker tokens may carry",
        ),
    ],
    ids=[
        "other key",
        "expired",
        "malformed",
        "empty",
        "alg none",
        "hs256",
        "hs256 with the public key",
        "es256",
        "unknown role",
        "old client role",
        "no role",
        "other issuer",
        "names on admin",
    ],
)
def test_invalid_tokens_are_refused_saying_why(token: str, message: str) -> None:
    with pytest.raises(TokenError) as info:
        verify_token(PUBLIC, token)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("role", "subject", "ttl", "names"),
    [
        ("root", "a", 1, None),
        ("client", "a", 1, None),
        ("writer", "", 1, None),
        ("writer", "a", 0, None),
        ("writer", "a", 1, "a-*"),
        ("worker", "a", 1, ""),
    ],
)
def test_create_token_checks_its_arguments(
    role: str, subject: str, ttl: float, names: str | None
) -> None:
    with pytest.raises(ValueError):
        create_token(KEY, role, subject, ttl, names=names)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("30m", 1800), ("1h", 3600), ("7d", 604800), ("45", 45), ("1.5h", 5400)],
)
def test_parse_ttl(text: str, seconds: float) -> None:
    assert parse_ttl(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "-1h", "1w", "h"])
def test_parse_ttl_refuses_non_durations(text: str) -> None:
    with pytest.raises(ValueError, match="ttl"):
        parse_ttl(text)


def test_keygen_writes_a_private_key_only_its_owner_reads(tmp_path: Path) -> None:
    # Act
    private, public = write_keypair(tmp_path / "auth")

    # Assert: the pair signs and verifies; the private key is 0600; no silent replacement
    assert (private.name, public.name) == ("private.pem", "public.pem")
    assert os.stat(private).st_mode & 0o777 == 0o600
    token = create_token(read_private_key(private), "reader", "r", 60)
    assert verify_token(read_public_key(public), token).role == "reader"
    before = private.read_bytes()
    with pytest.raises(FileExistsError):
        write_keypair(tmp_path / "auth")
    assert private.read_bytes() == before


def test_key_files_that_are_not_ed25519_keys_are_refused_naming_the_file(tmp_path: Path) -> None:
    # Arrange
    private, public = write_keypair(tmp_path)
    (tmp_path / "junk.pem").write_text("not a key\n")
    ec_key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "ec.pem").write_bytes(
        ec_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )

    # Act / Assert
    with pytest.raises(KeyFileError, match=r"^public_key_file .*missing: No such file"):
        read_public_key(tmp_path / "missing")
    with pytest.raises(KeyFileError, match=r"^private_key_file .*junk.pem: is not an unencrypted"):
        read_private_key(tmp_path / "junk.pem")
    with pytest.raises(KeyFileError, match=r"^x .*ec.pem: is not an Ed25519 key"):
        read_private_key(tmp_path / "ec.pem", "x")
    with pytest.raises(KeyFileError, match=r"public.pem: is not an unencrypted PEM private"):
        read_private_key(public)
    with pytest.raises(KeyFileError, match=r"private.pem: is not a PEM public key"):
        read_public_key(private)


def test_a_self_signed_source_renews_its_token_at_half_life(monkeypatch) -> None:
    now = [1_000_000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    source = TokenSource(private_key=KEY, role="admin", subject="coordinator", ttl_s=100)
    first = source()
    now[0] += 40
    assert source() == first
    now[0] += 20
    renewed = source()
    assert renewed != first
    p = verify_token(PUBLIC, renewed, leeway_s=1e10)
    assert (p.subject, p.role, p.expires_at) == ("coordinator", "admin", now[0] + 100)


def test_a_token_file_source(tmp_path: Path) -> None:
    (tmp_path / "t").write_text(" abc.def.ghi \n")
    assert TokenSource.from_file(tmp_path / "t")() == "abc.def.ghi"
    (tmp_path / "empty").write_text("")
    with pytest.raises(KeyFileError, match=r"^--token-file .*empty: is empty"):
        TokenSource.from_file(tmp_path / "empty", "--token-file")
