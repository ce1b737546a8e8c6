"""The dashboard's login sessions, and the rules a browser request must pass before any page.

A login verifies a token once and keeps its principal in memory under an opaque random
session id; the browser's cookie holds only that id (the token itself never leaves the login
form), and a session ends at its token's ``exp``. The number of sessions is bounded
(``dashboard_max_sessions``): a login beyond it ends the session closest to expiry.

``host_names`` lists the Host header values the dashboard answers (DNS rebinding: a page of
``evil.example`` whose name resolves to 127.0.0.1 sends ``Host: evil.example``).
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Callable, Container, Iterable

from shared.security.exposure import is_wildcard
from shared.security.tokens import Principal

SESSION_ID_BYTES = 32  # 256 random bits per session id
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


class Sessions:
    """Session id -> principal, each until its token's ``exp``; at most ``max_sessions``."""

    def __init__(self, max_sessions: int, clock: Callable[[], float] = time.time) -> None:
        """No sessions yet.

        Args:
            max_sessions: ``dashboard_max_sessions``.
            clock: wall-clock seconds, as token ``exp`` claims are (injected by tests).
        """
        self._max = max_sessions
        self._clock = clock
        self._by_id: dict[str, Principal] = {}

    def __len__(self) -> int:
        """Sessions kept (expired ones included until the next ``create``)."""
        return len(self._by_id)

    def create(self, principal: Principal) -> str:
        """Open a session for ``principal``; return its new id (URL-safe, 43 characters).

        Expired sessions are dropped first; when ``max_sessions`` remain, the one that
        expires soonest is ended.
        """
        now = self._clock()
        for sid in [s for s, p in self._by_id.items() if p.expires_at <= now]:
            del self._by_id[sid]
        while len(self._by_id) >= self._max:
            del self._by_id[min(self._by_id, key=lambda s: self._by_id[s].expires_at)]
        sid = secrets.token_urlsafe(SESSION_ID_BYTES)
        self._by_id[sid] = principal
        return sid

    def get(self, sid: str, revoked: Container[str] = ()) -> Principal | None:
        """The principal of a live session, or None (unknown id, its token expired or revoked).

        Args:
            sid: the session id from the cookie.
            revoked: token ids refused now (the coordinator's revocation list); a session
                opened with a token revoked since then ends.
        """
        principal = self._by_id.get(sid)
        if principal is None:
            return None
        if principal.expires_at <= self._clock() or principal.token_id in revoked:
            del self._by_id[sid]
            return None
        return principal

    def end(self, sid: str) -> None:
        """End a session (nothing if unknown)."""
        self._by_id.pop(sid, None)


def host_names(dashboard_host: str, extra: Iterable[str]) -> frozenset[str]:
    """The host names a request's Host header may carry, lower-case, without brackets.

    Args:
        dashboard_host: the address bound; a wildcard (0.0.0.0, ::) adds this machine's
            host name instead.
        extra: ``dashboard_host_names``.
    """
    names = {*LOOPBACK_NAMES, *extra}
    names.add(socket.gethostname() if is_wildcard(dashboard_host) else dashboard_host)
    return frozenset(n.strip("[]").lower() for n in names if n)


def host_of(header: str) -> str:
    """The name of a Host header value, without port or brackets, lower-case.

    ``example.org:8080`` -> ``example.org``; ``[::1]:8080`` -> ``::1``; ``::1`` -> ``::1``.
    """
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header
    if header.count(":") == 1:
        return header.split(":", 1)[0]
    return header
