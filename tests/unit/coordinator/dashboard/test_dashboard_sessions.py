"""Dashboard sessions (opaque ids, ending at the token's exp, bounded) and Host parsing."""

from __future__ import annotations

import pytest

from coordinator.dashboard.sessions import Sessions, host_names, host_of
from shared.security.tokens import Principal


def test_a_session_ends_at_its_tokens_exp() -> None:
    now = [1000.0]
    sessions = Sessions(10, clock=lambda: now[0])
    sid = sessions.create(Principal("alice", "reader", 1010.0))

    alive = sessions.get(sid)
    now[0] = 1010.0
    ended = sessions.get(sid)

    assert alive == Principal("alice", "reader", 1010.0)
    assert ended is None and len(sessions) == 0


def test_a_session_ends_when_its_token_is_revoked() -> None:
    sessions = Sessions(10, clock=lambda: 0.0)
    sid = sessions.create(Principal("alice", "reader", 1010.0, token_id="j1"))

    alive = sessions.get(sid, revoked={"other"})
    ended = sessions.get(sid, revoked={"j1"})

    assert alive is not None and ended is None and len(sessions) == 0


def test_ids_are_random_and_unguessable() -> None:
    sessions = Sessions(10, clock=lambda: 0.0)
    ids = {sessions.create(Principal("a", "reader", 1.0)) for _ in range(5)}

    assert len(ids) == 5 and all(len(i) == 43 for i in ids)
    assert sessions.get("") is None and sessions.get("A" * 43) is None


def test_beyond_the_cap_the_session_closest_to_expiry_ends() -> None:
    sessions = Sessions(2, clock=lambda: 0.0)
    late = sessions.create(Principal("a", "reader", 300.0))
    soon = sessions.create(Principal("b", "reader", 100.0))

    newest = sessions.create(Principal("c", "admin", 200.0))

    assert sessions.get(soon) is None
    assert sessions.get(late) is not None and sessions.get(newest) is not None
    assert len(sessions) == 2


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("127.0.0.1:8080", "127.0.0.1"),
        ("LocalHost:1", "localhost"),
        ("[::1]:8080", "::1"),
        ("[::1]", "::1"),
        ("::1", "::1"),
        ("evil.example", "evil.example"),
        ("", ""),
    ],
)
def test_host_of(header: str, name: str) -> None:
    assert host_of(header) == name


def test_host_names_are_loopback_the_bound_host_and_the_configured_ones() -> None:
    names = host_names("10.0.0.5", ["Dash.Example.org"])

    assert names == {"localhost", "127.0.0.1", "::1", "10.0.0.5", "dash.example.org"}
    assert "" not in host_names("0.0.0.0", [])
