"""Bearer tokens: JWTs signed with HS256 (RFC 7519, via PyJWT), carrying a subject and a role.

Claims: ``sub`` (who: a user, a client program or a daemon's name), ``role`` (``worker``,
``client`` or ``admin``), ``iat`` and ``exp`` (Unix seconds), ``iss`` = ``neuroshard``.
Every daemon holds the same secret (``auth.secret_file``): it verifies incoming tokens and signs
the ``worker`` token it presents itself (unless ``auth.token_file`` gives one).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import jwt

ROLES = ("worker", "client", "admin")
ISSUER = "neuroshard"
MIN_SECRET_BYTES = 32
_TTL = re.compile(r"^(\d+(?:\.\d+)?)\s*([smhd]?)$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class TokenError(Exception):
    """A token is missing, malformed, badly signed, expired or names no known role
    (UNAUTHENTICATED); the message says which."""


class SecretError(ValueError):
    """The secret file is missing or too short; the message names the file."""


@dataclass(frozen=True)
class Principal:
    """Who made a request: the token's subject and role, and when the token expires."""

    subject: str
    role: str
    expires_at: float


def parse_ttl(text: str) -> float:
    """``"90s"``, ``"30m"``, ``"1h"``, ``"7d"`` or plain seconds -> seconds.

    Raises:
        ValueError: not a positive duration (names the value).
    """
    m = _TTL.match(text.strip().lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"ttl: expected a duration like 90s, 30m, 1h or 7d, got {text!r}")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def read_secret(path: str | Path) -> bytes:
    """The HS256 secret in ``path`` (surrounding whitespace stripped).

    Raises:
        SecretError: missing, unreadable or shorter than 32 bytes.
    """
    p = Path(path)
    try:
        secret = p.read_bytes().strip()
    except OSError as exc:
        raise SecretError(f"secret_file {p}: {exc.strerror or exc}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(
            f"secret_file {p}: holds {len(secret)} bytes, need at least {MIN_SECRET_BYTES} "
            f"(neuroshard token secret {p})"
        )
    return secret


def write_secret(path: str | Path) -> Path:
    """Write a new random secret (64 hex characters) to ``path`` with mode 0600."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.unlink(missing_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return p


def create_token(
    secret: bytes, role: str, subject: str, ttl_s: float, now: float | None = None
) -> str:
    """Sign a token for ``subject`` with ``role``, valid for ``ttl_s`` seconds.

    Raises:
        ValueError: unknown role, empty subject or ttl_s <= 0.
    """
    if role not in ROLES:
        raise ValueError(f"role: expected one of {', '.join(ROLES)}, got {role!r}")
    if not subject:
        raise ValueError("subject: must not be empty")
    if ttl_s <= 0:
        raise ValueError(f"ttl: must be > 0 seconds, got {ttl_s}")
    iat = int(time.time() if now is None else now)
    claims = {
        "sub": subject,
        "role": role,
        "iss": ISSUER,
        "iat": iat,
        "exp": iat + max(1, round(ttl_s)),
    }
    return jwt.encode(claims, secret, algorithm="HS256")


def _utc(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def verify_token(secret: bytes, token: str, leeway_s: float = 5.0) -> Principal:
    """Check the signature, expiry and claims of ``token``.

    Raises:
        TokenError: with a message saying what is wrong (expired at ..., bad signature, ...).
    """
    try:
        claims = jwt.decode(
            token,
            secret,
            algorithms=["HS256"],
            issuer=ISSUER,
            leeway=leeway_s,
            options={"require": ["exp", "iat", "sub", "role"]},
        )
    except jwt.ExpiredSignatureError:
        exp = jwt.decode(token, options={"verify_signature": False}).get("exp", 0)
        raise TokenError(f"token expired at {_utc(float(exp))}") from None
    except jwt.InvalidSignatureError:
        raise TokenError("token signature is invalid (signed with another secret?)") from None
    except jwt.MissingRequiredClaimError as exc:
        raise TokenError(f"token lacks the {exc.claim!r} claim") from None
    except jwt.InvalidIssuerError:
        raise TokenError(f"token was not issued by {ISSUER}") from None
    except jwt.ImmatureSignatureError:
        raise TokenError("token is not valid yet (issued in the future: clock skew?)") from None
    except jwt.InvalidTokenError as exc:
        raise TokenError(f"token is malformed ({exc})") from None
    role = claims["role"]
    if role not in ROLES:
        raise TokenError(f"token has unknown role {role!r} (expected {', '.join(ROLES)})")
    return Principal(str(claims["sub"]), role, float(claims["exp"]))


class TokenSource:
    """The token a process presents: a fixed one, or one it signs itself and renews when
    less than half of its lifetime is left (daemons, with ``ttl_s``)."""

    def __init__(
        self,
        token: str | None = None,
        *,
        secret: bytes | None = None,
        role: str = "worker",
        subject: str = "",
        ttl_s: float = 3600.0,
    ) -> None:
        if (token is None) == (secret is None):
            raise ValueError("give either a token or a secret to sign one with")
        self._fixed = token.strip() if token is not None else None
        self._secret, self._role, self._subject, self._ttl_s = secret, role, subject, ttl_s
        self._token, self._renew_at = "", 0.0
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str | Path) -> TokenSource:
        """The token stored in ``path``.

        Raises:
            SecretError: missing or empty file (names it).
        """
        p = Path(path)
        try:
            token = p.read_text().strip()
        except OSError as exc:
            raise SecretError(f"token_file {p}: {exc.strerror or exc}") from None
        if not token:
            raise SecretError(f"token_file {p}: is empty")
        return cls(token)

    def __call__(self) -> str:
        if self._fixed is not None:
            return self._fixed
        now = time.time()
        with self._lock:
            if now >= self._renew_at:
                assert self._secret is not None
                self._token = create_token(
                    self._secret, self._role, self._subject, self._ttl_s, now
                )
                self._renew_at = now + self._ttl_s / 2
            return self._token
