"""Bearer tokens of people and programs: JWTs signed with EdDSA over Ed25519 (RFC 7519, RFC 8037).

Made and checked with PyJWT and cryptography. Daemons never present tokens: they prove who they
are by their TLS certificates (``shared.security.identity``). A token carries a subject, a
role, an audience and an id.

Claims: ``sub`` (who: a person or a program), ``role`` (``reader``, ``writer`` or ``admin``),
``aud`` (where it may be presented: ``neuroshard``, the coordinator, for tokens people hold;
``neuroshard-data``, the workers' keyed memory RPCs, for the short-lived data-plane tokens the
coordinator mints for a caller in ``GetSlotMap``), ``jti`` (the token's id, which a revocation
list names), ``iat`` and ``exp`` (Unix seconds), ``iss`` = ``neuroshard``.

Audiences keep a token from being replayed with more rights than its holder has where it is
replayed: a worker sees only data-plane tokens (the client library sends nothing else to
workers), and the coordinator refuses them; a worker refuses coordinator tokens. Lifetimes are
capped per role (``MAX_TTL_S``), at creation and again at verification (a token signed with a
longer lifetime is refused).

The coordinator holds the private key (``auth.private_key_file``) and signs; every daemon
verifies with the public key (``auth.public_key_file``), so a daemon or person that holds only
the public key cannot mint a token. Verification accepts the ``EdDSA`` algorithm only: an
unsigned (``alg: none``) or HMAC-signed token is refused whatever its claims.
"""

from __future__ import annotations

import datetime as dt
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Container
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

ROLES = ("reader", "writer", "admin")  # the roles of tokens (people and programs)
# Roles of principals that certificates make (``shared.security.identity``), never tokens.
DAEMON_ROLES = ("coordinator", "worker")
ISSUER = "neuroshard"
AUD_COORDINATOR = "neuroshard"  # tokens people hold, presented to the coordinator
AUD_DATA = "neuroshard-data"  # data-plane tokens, presented to workers' keyed memory RPCs
AUDIENCES = (AUD_COORDINATOR, AUD_DATA)
# Longest lifetime per role, seconds: at creation and at verification (a token signed with a
# longer one is refused). Data-plane tokens live an hour at most whatever their role.
MAX_TTL_S = {"reader": 30 * 86400.0, "writer": 30 * 86400.0, "admin": 7 * 86400.0}
MAX_DATA_TTL_S = 3600.0
ALGORITHM = "EdDSA"
PRIVATE_KEY_NAME, PUBLIC_KEY_NAME = "private.pem", "public.pem"
_TTL = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd]?)$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
K = TypeVar("K", Ed25519PrivateKey, Ed25519PublicKey)


class TokenError(Exception):
    """A token is missing, malformed, not EdDSA, badly signed, expired or has a bad role.

    Maps to UNAUTHENTICATED; the message says which of these it is.
    """


class DataTokenRefused(ValueError):
    """No data-plane token for a daemon, or for a token about to expire (UNAUTHENTICATED)."""


class KeyFileError(ValueError):
    """A key or token file is missing, unreadable or not what it should be.

    The message starts with the file's role (``public_key_file``, ``--token-file``, ...) and
    its path; daemons report it as a ConfigError and exit 2.
    """


@dataclass(frozen=True)
class Principal:
    """Who made a request, from a verified token.

    A person's or program's principal comes from a verified token; a daemon's
    (``coordinator``, ``worker``) from the identity in its TLS certificate.

    Attributes:
        subject: the ``sub`` claim (a person, a program), or the daemon's name from its
            certificate (a worker's name; ``coordinator``).
        role: ``reader``, ``writer``, ``admin`` (tokens), ``worker`` or ``coordinator``
            (certificates).
        expires_at: the ``exp`` claim, Unix seconds; ``inf`` for a certificate's principal
            (TLS checked the certificate's validity at the handshake).
        audience: the token's ``aud`` (``AUD_COORDINATOR`` or ``AUD_DATA``); "" for daemons.
        token_id: the token's ``jti``; "" for daemons.
        hosts: a daemon certificate's DNS names and IPs; empty for tokens.
    """

    subject: str
    role: str
    expires_at: float
    audience: str = ""
    token_id: str = ""
    hosts: tuple[str, ...] = ()

    @property
    def is_daemon(self) -> bool:
        """Whether a daemon certificate, not a token, made this principal."""
        return self.role in DAEMON_ROLES

    def may_act_as(self, name: str) -> bool:
        """Tell whether this caller may act as worker ``name``: only a worker, as itself."""
        return self.role == "worker" and bool(name) and name == self.subject

    def describe(self) -> str:
        """Name the caller in messages: ``worker 'w0'``, ``reader 'alice'``."""
        return f"{self.role} {self.subject!r}"


def parse_ttl(text: str) -> float:
    """Parse a token lifetime such as ``"90s"``, ``"30m"``, ``"1h"``, ``"7d"`` or ``"45"``.

    Returns:
        The duration in seconds (plain numbers are seconds).

    Raises:
        ValueError: not a positive duration; the message starts with ``ttl:``.
    """
    m = _TTL.match(text.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"ttl: expected a duration like 90s, 30m, 1h or 7d, got {text!r}")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def write_keypair(directory: str | Path) -> tuple[Path, Path]:
    """Write a new Ed25519 token key pair into ``directory`` (created if needed).

    ``private.pem`` is PKCS#8, created with mode 0600 (never readable by others, not even
    briefly); ``public.pem`` is SubjectPublicKeyInfo, mode 0644.

    Returns:
        The paths of ``private.pem`` and ``public.pem``.

    Raises:
        FileExistsError: ``private.pem`` exists already (replacing it would invalidate every
            token signed with it; remove it first if that is meant).
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    private_path, public_path = d / PRIVATE_KEY_NAME, d / PUBLIC_KEY_NAME
    key = Ed25519PrivateKey.generate()
    private_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(private_pem)
    public_path.unlink(missing_ok=True)
    public_path.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private_path, public_path


def _read_bytes(field: str, path: str | Path) -> bytes:
    """The bytes of ``path``; KeyFileError naming ``field`` when it cannot be read."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise KeyFileError(f"{field} {path}: {exc.strerror or exc}") from None


def _read_ed25519(
    field: str, path: str | Path, load: Callable[[bytes], object], kind: type[K], what: str
) -> K:
    """Read ``path``, parse it with ``load`` and check that the key is a ``kind``.

    Raises:
        KeyFileError: missing, unreadable, not ``what`` (``load`` refused it) or not
            Ed25519 (names ``field`` and the file).
    """
    data = _read_bytes(field, path)
    try:
        key = load(data)
    except (ValueError, TypeError):
        raise KeyFileError(f"{field} {path}: is not {what} (neuroshard token keygen)") from None
    if not isinstance(key, kind):
        raise KeyFileError(f"{field} {path}: is not an Ed25519 key ({type(key).__name__})")
    return key


def read_private_key(path: str | Path, field: str = "private_key_file") -> Ed25519PrivateKey:
    """Load the Ed25519 private key that signs tokens from a PEM file.

    Args:
        path: the PEM file (PKCS#8, unencrypted).
        field: the config key or flag, named in errors.

    Raises:
        KeyFileError: missing, unreadable, encrypted, not PEM or not Ed25519 (names
            ``field`` and the file).
    """
    return _read_ed25519(
        field,
        path,
        lambda data: serialization.load_pem_private_key(data, password=None),
        Ed25519PrivateKey,  # type: ignore[type-abstract]  # for isinstance only (mypy#4717)
        "an unencrypted PEM private key",
    )


def read_public_key(path: str | Path, field: str = "public_key_file") -> Ed25519PublicKey:
    """Load the Ed25519 public key that verifies tokens from a PEM file.

    Args:
        path: the PEM file (SubjectPublicKeyInfo).
        field: the config key or flag, named in errors.

    Raises:
        KeyFileError: missing, unreadable, not PEM or not Ed25519 (names ``field`` and the
            file).
    """
    return _read_ed25519(
        field,
        path,
        serialization.load_pem_public_key,
        Ed25519PublicKey,  # type: ignore[type-abstract]  # for isinstance only (mypy#4717)
        "a PEM public key",
    )


def read_token_file(path: str | Path, field: str = "token_file") -> str:
    """Read the token stored in ``path``, without surrounding whitespace.

    Args:
        path: a file holding one token (as ``neuroshard token create`` prints it).
        field: the config key or flag, named in errors.

    Raises:
        KeyFileError: missing, unreadable or empty (names ``field`` and the file).
    """
    token = _read_bytes(field, path).decode(errors="replace").strip()
    if not token:
        raise KeyFileError(f"{field} {path}: is empty")
    return token


def max_ttl_s(role: str, audience: str = AUD_COORDINATOR) -> float:
    """The longest lifetime a token of ``role`` for ``audience`` may have, seconds."""
    cap = MAX_TTL_S.get(role, 0.0)
    return min(cap, MAX_DATA_TTL_S) if audience == AUD_DATA else cap


def create_token(
    private_key: Ed25519PrivateKey,
    role: str,
    subject: str,
    ttl_s: float,
    now: float | None = None,
    audience: str = AUD_COORDINATOR,
) -> str:
    """Sign a token for ``subject`` with ``role`` and ``audience``, valid for ``ttl_s`` seconds.

    Args:
        private_key: the coordinator's token-signing key.
        role: ``reader``, ``writer`` or ``admin`` (daemons use certificates, not tokens).
        subject: who the token is for (a person or a program).
        ttl_s: lifetime, seconds; rounded to whole seconds, at least 1, at most
            ``max_ttl_s(role, audience)``.
        now: issue time, Unix seconds (default: the current time).
        audience: ``AUD_COORDINATOR`` (default) or ``AUD_DATA``.

    Returns:
        The compact JWT (``header.claims.signature``), with a random ``jti``.

    Raises:
        ValueError: unknown role or audience, empty subject, ttl_s <= 0 or above the role's
            cap; the message starts with the field (``role:``, ``subject:``, ``ttl:``).
    """
    if role not in ROLES:
        hint = " (daemons authenticate by certificate)" if role in DAEMON_ROLES else ""
        raise ValueError(f"role: expected one of {', '.join(ROLES)}, got {role!r}{hint}")
    if audience not in AUDIENCES:
        raise ValueError(f"audience: expected one of {', '.join(AUDIENCES)}, got {audience!r}")
    if not subject:
        raise ValueError("subject: must not be empty")
    if ttl_s <= 0:
        raise ValueError(f"ttl: must be > 0 seconds, got {ttl_s}")
    cap = max_ttl_s(role, audience)
    if round(ttl_s) > cap:
        raise ValueError(f"ttl: at most {cap:.0f} s for a {role} token, got {ttl_s:.0f} s")
    iat = int(time.time() if now is None else now)
    claims: dict[str, object] = {
        "sub": subject,
        "role": role,
        "aud": audience,
        "jti": uuid.uuid4().hex,
        "iss": ISSUER,
        "iat": iat,
        "exp": iat + max(1, round(ttl_s)),
    }
    return jwt.encode(claims, private_key, algorithm=ALGORITHM)


def mint_data_token(
    private_key: Ed25519PrivateKey, caller: Principal, ttl_s: float, now: float | None = None
) -> tuple[str, float]:
    """Sign a data-plane token for a caller of the coordinator (``GetSlotMap``).

    The token has the caller's subject, audience ``AUD_DATA`` and role ``reader`` for a
    reader, ``writer`` for a writer or an admin (the data plane knows no more), and lives
    ``ttl_s`` seconds but never past the caller's own token.

    Args:
        private_key: the coordinator's token-signing key.
        caller: a person's or program's principal (a coordinator-audience token's).
        ttl_s: lifetime, seconds (at most ``MAX_DATA_TTL_S``).
        now: issue time, Unix seconds (default: the current time).

    Returns:
        The token and its expiry, Unix seconds.

    Raises:
        DataTokenRefused: the caller is a daemon, or its token has expired (UNAUTHENTICATED).
    """
    if caller.role not in ROLES:
        raise DataTokenRefused(f"data-plane tokens are for people and programs, not {caller.role}s")
    now = time.time() if now is None else now
    ttl = min(ttl_s, MAX_DATA_TTL_S, caller.expires_at - now)
    if ttl < 1:
        raise DataTokenRefused("the caller's token expires within a second")
    role = "reader" if caller.role == "reader" else "writer"
    token = create_token(private_key, role, caller.subject, ttl, now=now, audience=AUD_DATA)
    return token, int(now) + max(1, round(ttl))


def _utc(ts: float) -> str:
    """``ts`` (Unix seconds) as an ISO 8601 UTC time for messages."""
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _algorithm_of(token: str) -> str:
    """Read the header's ``alg`` without verifying anything.

    Raises:
        TokenError: the token is not a JWT.
    """
    try:
        return str(jwt.get_unverified_header(token).get("alg"))
    except jwt.InvalidTokenError as exc:
        raise TokenError(f"token is malformed ({exc})") from None


def verify_token(
    public_key: Ed25519PublicKey,
    token: str,
    leeway_s: float = 5.0,
    audience: str = AUD_COORDINATOR,
    revoked: Container[str] = (),
) -> Principal:
    """Check the algorithm (EdDSA only), signature, expiry, audience, lifetime and claims.

    The algorithm is read from the header and refused unless it is EdDSA before PyJWT
    verifies anything, so neither an unsigned (``alg: none``) nor an HMAC token signed with
    the public key as secret can pass.

    Args:
        public_key: the coordinator's token-verifying key.
        token: the compact JWT.
        leeway_s: clock skew tolerated on ``exp`` and ``iat``, seconds.
        audience: the ``aud`` this daemon accepts (the coordinator ``AUD_COORDINATOR``, a
            worker ``AUD_DATA``).
        revoked: token ids (``jti``) refused (the daemon's revocation list).

    Returns:
        The caller the token names.

    Raises:
        TokenError: with a message saying what is wrong (UNAUTHENTICATED at the RPC layer).
    """
    alg = _algorithm_of(token)
    if alg != ALGORITHM:
        raise TokenError(
            f"token is signed with alg {alg!r}; only {ALGORITHM} (Ed25519) tokens are accepted"
        )
    try:
        claims = jwt.decode(
            token,
            public_key,
            algorithms=[ALGORITHM],
            issuer=ISSUER,
            audience=audience,
            leeway=leeway_s,
            options={"require": ["exp", "iat", "sub", "role", "aud", "jti"]},
        )
    except jwt.ExpiredSignatureError:
        exp = jwt.decode(token, options={"verify_signature": False}).get("exp", 0)
        raise TokenError(f"token expired at {_utc(float(exp))}") from None
    except jwt.InvalidSignatureError:
        raise TokenError("token signature is invalid (signed with another key?)") from None
    except jwt.MissingRequiredClaimError as exc:
        raise TokenError(f"token lacks the {exc.claim!r} claim") from None
    except jwt.InvalidAudienceError:
        raise TokenError(
            f"token is not for this daemon (audience {_audience_of(token)!r}, "
            f"expected {audience!r})"
        ) from None
    except jwt.InvalidIssuerError:
        raise TokenError(f"token was not issued by {ISSUER}") from None
    except jwt.ImmatureSignatureError:
        raise TokenError("token is not valid yet (issued in the future: clock skew?)") from None
    except jwt.InvalidTokenError as exc:
        raise TokenError(f"token is malformed ({exc})") from None
    role, jti = claims["role"], str(claims["jti"])
    if role not in ROLES:
        raise TokenError(f"token has unknown role {role!r} (expected {', '.join(ROLES)})")
    lifetime = float(claims["exp"]) - float(claims["iat"])
    if lifetime > max_ttl_s(role, audience) + leeway_s:
        raise TokenError(
            f"token lifetime {lifetime:.0f} s exceeds the {max_ttl_s(role, audience):.0f} s "
            f"a {role} token may have"
        )
    if jti in revoked:
        raise TokenError(f"token {jti} is revoked")
    return Principal(str(claims["sub"]), role, float(claims["exp"]), audience, jti)


def _audience_of(token: str) -> str:
    """The unverified ``aud`` claim, for messages only."""
    try:
        return str(jwt.decode(token, options={"verify_signature": False}).get("aud", ""))
    except jwt.InvalidTokenError:
        return ""


class RevocationList:
    """Token ids (``jti``) that daemons refuse, read from ``auth.revoked_file``.

    The file holds one id per line (``#`` comments and blank lines ignored); ``neuroshard
    token revoke`` appends to it. The daemon re-reads it when its modification time changes,
    checking at most every ``check_interval_s``; a missing file is an empty list.
    """

    def __init__(self, path: str | Path | None, check_interval_s: float = 1.0) -> None:
        """Watch ``path`` (None: nothing is revoked)."""
        self._path = Path(path) if path else None
        self._interval = check_interval_s
        self._ids: frozenset[str] = frozenset()
        self._mtime: float | None = None
        self._checked_at = float("-inf")
        self._lock = threading.Lock()

    def __contains__(self, token_id: object) -> bool:
        """Tell whether ``token_id`` is revoked (re-reading the file when it changed)."""
        return token_id in self.current()

    def current(self) -> frozenset[str]:
        """The revoked ids now."""
        if self._path is None:
            return self._ids
        now = time.monotonic()
        if now - self._checked_at < self._interval:
            return self._ids
        with self._lock:
            self._checked_at = now
            try:
                mtime = self._path.stat().st_mtime
            except FileNotFoundError:
                self._ids, self._mtime = frozenset(), None
                return self._ids
            if mtime != self._mtime:
                self._ids = parse_revoked(self._path.read_text(errors="replace"))
                self._mtime = mtime
            return self._ids


def parse_revoked(text: str) -> frozenset[str]:
    """The token ids of a revocation file's text (one per line, ``#`` starts a comment)."""
    ids = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return frozenset(i for i in ids if i)


def token_id(token: str) -> str:
    """The ``jti`` of a token, unverified (for ``neuroshard token revoke TOKEN``).

    Raises:
        TokenError: not a JWT, or one without a ``jti``.
    """
    try:
        jti = jwt.decode(token, options={"verify_signature": False}).get("jti")
    except jwt.InvalidTokenError as exc:
        raise TokenError(f"token is malformed ({exc})") from None
    if not jti:
        raise TokenError("token has no 'jti' claim")
    return str(jti)


class TokenSource:
    """The fixed token a process presents; calling it returns the token to send now.

    Read from a file (``--token-file``) or given (``--token``). Channels call it from any
    thread.
    """

    def __init__(self, token: str) -> None:
        """Present ``token`` (surrounding whitespace is stripped)."""
        self._token = token.strip()

    @classmethod
    def from_file(cls, path: str | Path, field: str = "token_file") -> TokenSource:
        """Present the token stored in ``path`` (read once, now).

        Raises:
            KeyFileError: missing, unreadable or empty file (names ``field`` and the file).
        """
        return cls(read_token_file(path, field))

    def __call__(self) -> str:
        """Return the token to present."""
        return self._token
