"""Bearer tokens: JWTs signed with EdDSA over Ed25519 (RFC 7519, RFC 8037).

Made and checked with PyJWT and cryptography. A token carries a subject, a role and, on
worker tokens, an optional pattern of worker names.

Claims: ``sub`` (who: a person, a program or a daemon's name), ``role`` (``worker``,
``reader``, ``writer`` or ``admin``), ``iat`` and ``exp`` (Unix seconds), ``iss`` =
``neuroshard``, and ``names`` (worker tokens only: an fnmatch pattern such as
``neuroshard-worker-*`` for the pods of a StatefulSet that share one token).

The coordinator holds the private key (``auth.private_key_file``) and signs; every daemon
verifies with the public key (``auth.public_key_file``), so a daemon or person that holds only
the public key cannot mint a token. Verification accepts the ``EdDSA`` algorithm only: an
unsigned (``alg: none``) or HMAC-signed token is refused whatever its claims.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

ROLES = ("worker", "reader", "writer", "admin")
ISSUER = "neuroshard"
ALGORITHM = "EdDSA"
PRIVATE_KEY_NAME, PUBLIC_KEY_NAME = "private.pem", "public.pem"
_TTL = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd]?)$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
K = TypeVar("K", Ed25519PrivateKey, Ed25519PublicKey)


class TokenError(Exception):
    """A token is missing, malformed, not EdDSA, badly signed, expired or has a bad role.

    Maps to UNAUTHENTICATED; the message says which of these it is.
    """


class KeyFileError(ValueError):
    """A key or token file is missing, unreadable or not what it should be.

    The message starts with the file's role (``public_key_file``, ``--token-file``, ...) and
    its path; daemons report it as a ConfigError and exit 2.
    """


@dataclass(frozen=True)
class Principal:
    """Who made a request, from a verified token.

    Attributes:
        subject: the ``sub`` claim: a person, a program or a worker's name.
        role: ``worker``, ``reader``, ``writer`` or ``admin``.
        expires_at: the ``exp`` claim, Unix seconds.
        names: worker tokens only: an fnmatch pattern of further worker names the token may
            act as (``neuroshard-worker-*``), or None.
    """

    subject: str
    role: str
    expires_at: float
    names: str | None = None

    def may_act_as(self, name: str) -> bool:
        """Tell whether this token may act as worker ``name``.

        It may when ``name`` is the subject itself, or matches the ``names`` pattern
        (fnmatch, case-sensitive); an empty name matches no pattern.
        """
        if name == self.subject:
            return True
        return self.names is not None and bool(name) and fnmatch.fnmatchcase(name, self.names)

    def describe(self) -> str:
        """Name the token in messages: ``'w0'`` or ``'pool' (names 'neuroshard-worker-*')``."""
        return repr(self.subject) + (f" (names {self.names!r})" if self.names else "")


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


def create_token(
    private_key: Ed25519PrivateKey,
    role: str,
    subject: str,
    ttl_s: float,
    names: str | None = None,
    now: float | None = None,
) -> str:
    """Sign a token for ``subject`` with ``role``, valid for ``ttl_s`` seconds.

    Args:
        private_key: the coordinator's token-signing key.
        role: ``worker``, ``reader``, ``writer`` or ``admin``.
        subject: who the token is for (a person, a program, a worker's name).
        ttl_s: lifetime, seconds; rounded to whole seconds, at least 1.
        names: worker tokens only: an fnmatch pattern of the worker names the token may
            register as, besides ``subject`` (e.g. ``neuroshard-worker-*``).
        now: issue time, Unix seconds (default: the current time).

    Returns:
        The compact JWT (``header.claims.signature``).

    Raises:
        ValueError: unknown role, empty subject, ttl_s <= 0, or names on a non-worker token.
    """
    if role not in ROLES:
        raise ValueError(f"role: expected one of {', '.join(ROLES)}, got {role!r}")
    if not subject:
        raise ValueError("subject: must not be empty")
    if ttl_s <= 0:
        raise ValueError(f"ttl: must be > 0 seconds, got {ttl_s}")
    if names is not None and (role != "worker" or not names):
        raise ValueError(f"names: a non-empty pattern, on worker tokens only (role {role})")
    iat = int(time.time() if now is None else now)
    claims: dict[str, object] = {
        "sub": subject,
        "role": role,
        "iss": ISSUER,
        "iat": iat,
        "exp": iat + max(1, round(ttl_s)),
    }
    if names is not None:
        claims["names"] = names
    return jwt.encode(claims, private_key, algorithm=ALGORITHM)


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


def verify_token(public_key: Ed25519PublicKey, token: str, leeway_s: float = 5.0) -> Principal:
    """Check the algorithm (EdDSA only), signature, expiry and claims of ``token``.

    The algorithm is read from the header and refused unless it is EdDSA before PyJWT
    verifies anything, so neither an unsigned (``alg: none``) nor an HMAC token signed with
    the public key as secret can pass.

    Args:
        public_key: the coordinator's token-verifying key.
        token: the compact JWT.
        leeway_s: clock skew tolerated on ``exp`` and ``iat``, seconds.

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
            leeway=leeway_s,
            options={"require": ["exp", "iat", "sub", "role"]},
        )
    except jwt.ExpiredSignatureError:
        exp = jwt.decode(token, options={"verify_signature": False}).get("exp", 0)
        raise TokenError(f"token expired at {_utc(float(exp))}") from None
    except jwt.InvalidSignatureError:
        raise TokenError("token signature is invalid (signed with another key?)") from None
    except jwt.MissingRequiredClaimError as exc:
        raise TokenError(f"token lacks the {exc.claim!r} claim") from None
    except jwt.InvalidIssuerError:
        raise TokenError(f"token was not issued by {ISSUER}") from None
    except jwt.ImmatureSignatureError:
        raise TokenError("token is not valid yet (issued in the future: clock skew?)") from None
    except jwt.InvalidTokenError as exc:
        raise TokenError(f"token is malformed ({exc})") from None
    role, names = claims["role"], claims.get("names")
    if role not in ROLES:
        raise TokenError(f"token has unknown role {role!r} (expected {', '.join(ROLES)})")
    if names is not None and (role != "worker" or not isinstance(names, str) or not names):
        raise TokenError("token has a 'names' claim, which only worker tokens may carry")
    return Principal(str(claims["sub"]), role, float(claims["exp"]), names)


class TokenSource:
    """The token a process presents; calling it returns the token to send now.

    Either a fixed token (read from a file or given), or one the process signs itself with
    the private key and renews once half of its lifetime has passed (the coordinator's own
    ``admin`` token). Thread-safe: channels call it from any thread.
    """

    def __init__(
        self,
        token: str | None = None,
        *,
        private_key: Ed25519PrivateKey | None = None,
        role: str = "admin",
        subject: str = "",
        ttl_s: float = 3600.0,
    ) -> None:
        """Present ``token`` as is, or sign tokens with ``private_key``.

        Args:
            token: a fixed token (surrounding whitespace is stripped).
            private_key: the signing key, instead of ``token``.
            role: the role of signed tokens.
            subject: the subject of signed tokens.
            ttl_s: the lifetime of signed tokens, seconds.

        Raises:
            ValueError: both or neither of ``token`` and ``private_key`` given.
        """
        if (token is None) == (private_key is None):
            raise ValueError("give either a token or a private key to sign one with")
        self._fixed = token.strip() if token is not None else None
        self._key, self._role, self._subject, self._ttl_s = private_key, role, subject, ttl_s
        self._token, self._renew_at = "", 0.0
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str | Path, field: str = "token_file") -> TokenSource:
        """Present the token stored in ``path`` (read once, now).

        Raises:
            KeyFileError: missing, unreadable or empty file (names ``field`` and the file).
        """
        return cls(read_token_file(path, field))

    def __call__(self) -> str:
        """Return the token to present now, signing a new one when the last is half-used."""
        if self._fixed is not None:
            return self._fixed
        now = time.time()
        with self._lock:
            if now >= self._renew_at:
                assert self._key is not None
                self._token = create_token(
                    self._key, self._role, self._subject, self._ttl_s, now=now
                )
                self._renew_at = now + self._ttl_s / 2
            return self._token
