"""Bearer tokens: Ed25519 signing, verification and its one-line refusals; audiences, lifetime
caps, revocation, data-plane tokens; keys and TTLs."""

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

from shared.security import tokens
from shared.security.tokens import (
    AUD_COORDINATOR,
    AUD_DATA,
    MAX_DATA_TTL_S,
    MAX_TTL_S,
    KeyFileError,
    Principal,
    RevocationList,
    TokenError,
    TokenSource,
    create_token,
    max_ttl_s,
    mint_data_token,
    parse_revoked,
    parse_ttl,
    read_private_key,
    read_public_key,
    token_id,
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
    return {
        "sub": "x",
        "role": "admin",
        "aud": AUD_COORDINATOR,
        "jti": "j1",
        "iss": "neuroshard",
        "iat": now,
        "exp": now + 3600,  # made at collection: must outlive a long test run
        **extra,
    }


def _signed(**extra: object) -> str:
    """A token signed by hand with the right key (so only its claims can be wrong)."""
    return jwt.encode(_claims(**extra), KEY, algorithm="EdDSA")


def _without(claim: str) -> str:
    return jwt.encode({k: v for k, v in _claims().items() if k != claim}, KEY, algorithm="EdDSA")


def _hs256_signed_with(secret: bytes, claims: dict[str, object]) -> str:
    """An HS256 JWT built by hand (PyJWT refuses a PEM key as an HMAC secret, an attacker
    would not): the algorithm-confusion attack signs with the public key's PEM bytes."""
    head = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    body = _b64(json.dumps(claims).encode())
    mac = hmac.new(secret, f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{_b64(mac)}"


def test_a_token_round_trips_subject_role_audience_id_and_expiry() -> None:
    token = create_token(KEY, "writer", "alice", 60, now=1_000_000)
    assert jwt.get_unverified_header(token)["alg"] == "EdDSA"
    claims = jwt.decode(token, options={"verify_signature": False})
    assert claims["aud"] == AUD_COORDINATOR and len(claims["jti"]) == 32
    p = verify_token(PUBLIC, token, leeway_s=1e10)
    assert p == Principal("alice", "writer", 1_000_060.0, AUD_COORDINATOR, claims["jti"])
    assert not p.is_daemon and p.describe() == "writer 'alice'"


def test_every_token_has_its_own_id() -> None:
    ids = {token_id(create_token(KEY, "reader", "r", 60)) for _ in range(20)}
    assert len(ids) == 20


def test_no_token_acts_as_a_worker_only_a_worker_certificate_does() -> None:
    # Token principals (whatever their subject) never pass a worker-name binding.
    for role in ("reader", "writer", "admin"):
        p = verify_token(PUBLIC, create_token(KEY, role, "w0", 60))
        assert not p.may_act_as("w0") and not p.is_daemon
    # A certificate's worker principal acts as its own name only (exactly, case-sensitively).
    worker = Principal("w0", "worker", float("inf"))
    assert worker.is_daemon and worker.describe() == "worker 'w0'"
    assert worker.may_act_as("w0")
    assert not worker.may_act_as("w1") and not worker.may_act_as("W0")
    assert not worker.may_act_as("") and not worker.may_act_as("w0-1")
    coordinator = Principal("coordinator", "coordinator", float("inf"))
    assert coordinator.is_daemon and not coordinator.may_act_as("coordinator")


@pytest.mark.parametrize("role", ["worker", "coordinator"])
def test_daemon_roles_cannot_be_put_in_a_token(role: str) -> None:
    with pytest.raises(ValueError, match=r"^role: .*daemons authenticate by certificate"):
        create_token(KEY, role, "w0", 60)


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
        (_signed(role="root"), "token has unknown role 'root'"),
        (_signed(role="client"), "token has unknown role"),
        # The worker tokens of old, even well signed, are no tokens any more.
        (_signed(role="worker", sub="worker-0"), "token has unknown role 'worker'"),
        (_signed(role="coordinator", sub="coordinator"), "token has unknown role 'coordinator'"),
        (_without("role"), "token lacks the 'role' claim"),
        (_without("aud"), "token lacks the 'aud' claim"),
        (_without("jti"), "token lacks the 'jti' claim"),
        (_signed(iss="other"), "token was not issued by"),
        (
            _signed(aud=AUD_DATA, role="writer"),
            "token is not for this daemon (audience 'neuroshard-data', expected 'neuroshard')",
        ),
        (_signed(aud="elsewhere"), "token is not for this daemon (audience 'elsewhere'"),
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
        "old worker role",
        "coordinator role",
        "no role",
        "no audience",
        "no id",
        "other issuer",
        "data audience at the coordinator",
        "foreign audience",
    ],
)
def test_invalid_tokens_are_refused_saying_why(token: str, message: str) -> None:
    with pytest.raises(TokenError) as info:
        verify_token(PUBLIC, token)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("role", "subject", "ttl", "audience", "message"),
    [
        ("root", "a", 1, AUD_COORDINATOR, "role: "),
        ("client", "a", 1, AUD_COORDINATOR, "role: "),
        ("worker", "a", 1, AUD_COORDINATOR, "role: "),
        ("writer", "", 1, AUD_COORDINATOR, "subject: "),
        ("writer", "a", 0, AUD_COORDINATOR, "ttl: "),
        ("writer", "a", 1, "neuroshard-worker", "audience: "),
    ],
)
def test_create_token_checks_its_arguments(
    role: str, subject: str, ttl: float, audience: str, message: str
) -> None:
    with pytest.raises(ValueError) as info:
        create_token(KEY, role, subject, ttl, audience=audience)
    assert str(info.value).startswith(message)


def test_a_coordinator_token_is_refused_by_a_worker() -> None:
    # A worker verifies with the data-plane audience: a person's coordinator token (an admin's
    # too) presented to it is refused, and so cannot be replayed there or captured from there.
    token = create_token(KEY, "admin", "root", 60)
    with pytest.raises(TokenError) as info:
        verify_token(PUBLIC, token, audience=AUD_DATA)
    assert str(info.value) == (
        "token is not for this daemon (audience 'neuroshard', expected 'neuroshard-data')"
    )


def test_a_data_plane_token_is_refused_by_the_coordinator() -> None:
    # What a worker sees (a data-plane token) is worth nothing at the coordinator.
    token = create_token(KEY, "writer", "alice", 60, audience=AUD_DATA)
    assert verify_token(PUBLIC, token, audience=AUD_DATA).audience == AUD_DATA
    with pytest.raises(TokenError, match=r"^token is not for this daemon \(audience 'neuroshard-d"):
        verify_token(PUBLIC, token)


def test_lifetimes_are_capped_per_role_and_audience() -> None:
    assert MAX_TTL_S == {"reader": 30 * 86400.0, "writer": 30 * 86400.0, "admin": 7 * 86400.0}
    assert max_ttl_s("admin") == 7 * 86400
    assert max_ttl_s("writer", AUD_DATA) == max_ttl_s("admin", AUD_DATA) == MAX_DATA_TTL_S == 3600
    assert max_ttl_s("worker") == 0  # no such token


@pytest.mark.parametrize(
    ("role", "audience", "cap"),
    [
        ("reader", AUD_COORDINATOR, 30 * 86400),
        ("writer", AUD_COORDINATOR, 30 * 86400),
        ("admin", AUD_COORDINATOR, 7 * 86400),
        ("reader", AUD_DATA, 3600),
        ("writer", AUD_DATA, 3600),
    ],
)
def test_a_lifetime_over_the_cap_is_refused_at_creation(role: str, audience: str, cap: int) -> None:
    # At the cap: signed, and verified.
    token = create_token(KEY, role, "a", cap, audience=audience)
    claims = jwt.decode(token, options={"verify_signature": False})
    assert claims["exp"] - claims["iat"] == cap
    assert verify_token(PUBLIC, token, audience=audience).role == role
    # A second more: refused, naming the cap.
    with pytest.raises(ValueError) as info:
        create_token(KEY, role, "a", cap + 1, audience=audience)
    assert str(info.value) == f"ttl: at most {cap} s for a {role} token, got {cap + 1} s"


@pytest.mark.parametrize(
    ("role", "audience", "lifetime"),
    [
        ("admin", AUD_COORDINATOR, 7 * 86400 + 60),
        ("admin", AUD_COORDINATOR, 10 * 365 * 86400),
        ("reader", AUD_COORDINATOR, 31 * 86400),
        ("writer", AUD_DATA, 2 * 3600),
        ("reader", AUD_DATA, 3600 + 60),
    ],
)
def test_a_token_signed_by_hand_with_a_longer_lifetime_is_refused(
    role: str, audience: str, lifetime: int
) -> None:
    # Arrange: whoever holds the key (or a bug) signs past the cap; the token is not expired.
    now = int(time.time())
    token = _signed(role=role, aud=audience, iat=now - 10, exp=now - 10 + lifetime)

    # Act / Assert
    with pytest.raises(TokenError) as info:
        verify_token(PUBLIC, token, audience=audience)
    cap = max_ttl_s(role, audience)
    assert str(info.value) == (
        f"token lifetime {lifetime} s exceeds the {cap:.0f} s a {role} token may have"
    )


def test_a_lifetime_within_the_leeway_of_the_cap_passes() -> None:
    now = int(time.time())
    token = _signed(role="admin", iat=now, exp=now + 7 * 86400 + 3)
    assert verify_token(PUBLIC, token, leeway_s=5).role == "admin"


def test_a_revoked_token_id_is_refused() -> None:
    # Arrange
    token = create_token(KEY, "admin", "root", 60)
    jti = token_id(token)

    # Act / Assert: refused while listed, by id, whatever else is right with it
    assert verify_token(PUBLIC, token, revoked={"other"}).token_id == jti
    with pytest.raises(TokenError) as info:
        verify_token(PUBLIC, token, revoked={"other", jti})
    assert str(info.value) == f"token {jti} is revoked"


def test_token_id_reads_the_id_without_verifying() -> None:
    token = create_token(OTHER, "reader", "r", 60)
    assert token_id(token) == jwt.decode(token, options={"verify_signature": False})["jti"]
    with pytest.raises(TokenError, match="^token is malformed"):
        token_id("not.a.jwt")
    with pytest.raises(TokenError, match="^token has no 'jti' claim"):
        token_id(_without("jti"))


def test_parse_revoked_skips_comments_and_blanks() -> None:
    text = "# revoked by ops\n\n a1 \nb2  # leaked in a log\n#c3\n"
    assert parse_revoked(text) == frozenset({"a1", "b2"})


class _Clock:
    """A stand-in for the ``time`` module in ``shared.security.tokens``."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()


def test_the_revocation_file_is_re_read_when_it_changes(tmp_path: Path, monkeypatch) -> None:
    # Arrange: a list checked at most every second, of a file that does not exist yet
    clock = _Clock()
    monkeypatch.setattr(tokens, "time", clock)
    path = tmp_path / "revoked"
    revoked = RevocationList(path, check_interval_s=1.0)
    assert "a1" not in revoked  # a missing file revokes nothing

    # Act / Assert: a new file is read once the interval has passed
    path.write_text("a1\n")
    os.utime(path, (100, 100))
    assert "a1" not in revoked  # checked less than a second ago
    clock.now += 1.0
    assert "a1" in revoked and "b2" not in revoked

    # an appended id (as `neuroshard token revoke` does) counts after the next check
    with path.open("a") as f:
        f.write("b2\n")
    os.utime(path, (200, 200))
    clock.now += 1.0
    assert revoked.current() == frozenset({"a1", "b2"})

    # a rewrite that un-revokes, and a removed file, count too
    path.write_text("b2\n")
    os.utime(path, (300, 300))
    clock.now += 1.0
    assert revoked.current() == frozenset({"b2"})
    path.unlink()
    clock.now += 1.0
    assert revoked.current() == frozenset()


def test_a_revocation_list_without_a_file_revokes_nothing() -> None:
    assert RevocationList(None).current() == frozenset()
    assert "anything" not in RevocationList(None)


def test_verification_consults_the_revocation_file(tmp_path: Path) -> None:
    token = create_token(KEY, "writer", "w", 60)
    path = tmp_path / "revoked"
    revoked = RevocationList(path, check_interval_s=0.0)
    assert verify_token(PUBLIC, token, revoked=revoked).subject == "w"
    path.write_text(token_id(token) + "\n")
    with pytest.raises(TokenError, match=r"^token [0-9a-f]{32} is revoked$"):
        verify_token(PUBLIC, token, revoked=revoked)


@pytest.mark.parametrize(
    ("caller_role", "data_role"), [("reader", "reader"), ("writer", "writer"), ("admin", "writer")]
)
def test_a_data_plane_token_carries_the_callers_rights_there(
    caller_role: str, data_role: str
) -> None:
    # Arrange
    now = time.time()
    caller = Principal("alice", caller_role, now + 86400, AUD_COORDINATOR, "j")

    # Act
    token, expires_at = mint_data_token(KEY, caller, ttl_s=600, now=now)

    # Assert: audience data, the data plane's role (an admin is a writer there), short-lived,
    # and refused by the coordinator
    p = verify_token(PUBLIC, token, audience=AUD_DATA)
    assert (p.subject, p.role, p.audience) == ("alice", data_role, AUD_DATA)
    assert p.expires_at == expires_at == int(now) + 600
    assert p.token_id != "j"
    with pytest.raises(TokenError, match="^token is not for this daemon"):
        verify_token(PUBLIC, token)


def test_a_data_plane_token_never_outlives_the_callers_token_nor_an_hour() -> None:
    now = time.time()
    short = Principal("alice", "reader", now + 120, AUD_COORDINATOR, "j")
    _, expires_at = mint_data_token(KEY, short, ttl_s=3600, now=now)
    assert expires_at == int(now) + 120
    long = Principal("alice", "reader", now + 86400, AUD_COORDINATOR, "j")
    _, expires_at = mint_data_token(KEY, long, ttl_s=7 * 86400, now=now)
    assert expires_at == int(now) + 3600


def test_no_data_plane_token_for_a_daemon_or_an_expiring_caller() -> None:
    now = time.time()
    for daemon in ("worker", "coordinator"):
        with pytest.raises(ValueError, match="not for|people and programs"):
            mint_data_token(KEY, Principal("w0", daemon, float("inf")), 600, now=now)
    with pytest.raises(ValueError, match="expires within a second"):
        mint_data_token(KEY, Principal("a", "reader", now + 0.5, AUD_COORDINATOR, "j"), 600, now)


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


def test_a_token_source_presents_its_fixed_token_and_signs_none() -> None:
    # Its self-signing path (a private key, renewal at half-life) had no caller: removed.
    source = TokenSource(" abc.def.ghi \n")

    assert source() == "abc.def.ghi" == source()
    with pytest.raises(TypeError):
        TokenSource(private_key=KEY)  # type: ignore[call-arg]


def test_a_token_file_source(tmp_path: Path) -> None:
    (tmp_path / "t").write_text(" abc.def.ghi \n")
    assert TokenSource.from_file(tmp_path / "t")() == "abc.def.ghi"
    (tmp_path / "empty").write_text("")
    with pytest.raises(KeyFileError, match=r"^--token-file .*empty: is empty"):
        TokenSource.from_file(tmp_path / "empty", "--token-file")
