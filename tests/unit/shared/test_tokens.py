"""Bearer tokens: signing, verification and its one-line refusals; secrets and TTLs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import jwt
import pytest

from shared.tokens import (
    Principal,
    SecretError,
    TokenError,
    TokenSource,
    create_token,
    parse_ttl,
    read_secret,
    verify_token,
    write_secret,
)

SECRET = b"s" * 32


def test_a_token_round_trips_subject_role_and_expiry() -> None:
    token = create_token(SECRET, "client", "alice", 60, now=1_000_000)
    p = verify_token(SECRET, token, leeway_s=1e10)
    assert p == Principal("alice", "client", 1_000_060.0)


@pytest.mark.parametrize(
    ("token", "message"),
    [
        (create_token(b"o" * 32, "admin", "eve", 60), "token signature is invalid"),
        (create_token(SECRET, "client", "bob", 10, now=0), "token expired at 1970-01-01T00:00:10Z"),
        ("not.a.jwt", "token is malformed"),
        (
            jwt.encode(
                {
                    "sub": "x",
                    "role": "root",
                    "iss": "neuroshard",
                    "iat": int(time.time()),
                    "exp": int(time.time()) + 60,
                },
                SECRET,
                algorithm="HS256",
            ),
            "token has unknown role 'root'",
        ),
        (
            jwt.encode(
                {
                    "sub": "x",
                    "iss": "neuroshard",
                    "iat": int(time.time()),
                    "exp": int(time.time()) + 60,
                },
                SECRET,
                algorithm="HS256",
            ),
            "token lacks the 'role' claim",
        ),
        (
            jwt.encode(
                {
                    "sub": "x",
                    "role": "admin",
                    "iss": "other",
                    "iat": int(time.time()),
                    "exp": int(time.time()) + 60,
                },
                SECRET,
                algorithm="HS256",
            ),
            "token was not issued by neuroshard",
        ),
    ],
)
def test_invalid_tokens_are_refused_saying_why(token: str, message: str) -> None:
    with pytest.raises(TokenError) as info:
        verify_token(SECRET, token)
    assert str(info.value).startswith(message)


def test_an_unsigned_token_is_refused() -> None:
    token = jwt.encode(
        {"sub": "x", "role": "admin", "iss": "neuroshard", "iat": 0, "exp": 2**40},
        None,
        algorithm="none",
    )
    with pytest.raises(TokenError):
        verify_token(SECRET, token)


@pytest.mark.parametrize(
    ("role", "subject", "ttl"), [("root", "a", 1), ("client", "", 1), ("client", "a", 0)]
)
def test_create_token_checks_its_arguments(role: str, subject: str, ttl: float) -> None:
    with pytest.raises(ValueError):
        create_token(SECRET, role, subject, ttl)


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


def test_secrets_are_private_and_long_enough(tmp_path: Path) -> None:
    path = write_secret(tmp_path / "auth" / "secret")
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert len(read_secret(path)) == 64
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(SecretError, match="holds 3 bytes, need at least 32"):
        read_secret(short)
    with pytest.raises(SecretError, match="missing"):
        read_secret(tmp_path / "missing")


def test_a_self_signed_source_renews_its_token_at_half_life(monkeypatch) -> None:
    now = [1_000_000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    source = TokenSource(secret=SECRET, role="worker", subject="w0", ttl_s=100)
    first = source()
    now[0] += 40
    assert source() == first
    now[0] += 20
    renewed = source()
    assert renewed != first
    assert verify_token(SECRET, renewed, leeway_s=1e10).expires_at == now[0] + 100


def test_a_token_file_source(tmp_path: Path) -> None:
    (tmp_path / "t").write_text(" abc.def.ghi \n")
    assert TokenSource.from_file(tmp_path / "t")() == "abc.def.ghi"
    (tmp_path / "empty").write_text("")
    with pytest.raises(SecretError, match="is empty"):
        TokenSource.from_file(tmp_path / "empty")
