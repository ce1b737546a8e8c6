"""The role table, bearer metadata, the CLI security flags and batch splitting."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest

from shared.auth import bearer_token, may_call
from shared.cli_security import ROLES, client_security_of, daemon_overrides
from shared.config import ConfigError
from shared.limits import batch_error, split_parts
from shared.slots import slot_of
from shared.tokens import ROLES as TOKEN_ROLES

C, W = "/neuroshard.v1.Coordinator/", "/neuroshard.v1.Worker/"


@pytest.mark.parametrize(
    ("role", "method", "allowed"),
    [
        ("worker", C + "RegisterWorker", True),
        ("worker", C + "Heartbeat", True),
        ("worker", C + "DrainWorker", True),
        ("worker", C + "SubmitJob", False),
        ("worker", C + "GetClusterStatus", False),
        ("worker", W + "Replicate", True),
        ("worker", W + "ReceiveSlots", True),
        ("worker", W + "ComputeGradients", True),
        ("worker", W + "Upsert", True),
        ("client", C + "SubmitJob", True),
        ("client", C + "WatchJob", True),
        ("client", C + "CancelJob", True),
        ("client", C + "TopK", True),
        ("client", C + "RegisterWorker", False),
        ("client", C + "DrainWorker", False),
        ("client", W + "Upsert", True),
        ("client", W + "Get", True),
        ("client", W + "Replicate", False),
        ("client", W + "Decay", False),
        ("client", W + "ApplySlotMap", False),
        ("admin", C + "DrainWorker", True),
        ("admin", W + "DumpSlots", True),
        ("client", "/grpc.health.v1.Health/Check", True),
        ("client", "/other.Service/Call", False),
    ],
)
def test_role_table(role: str, method: str, allowed: bool) -> None:
    assert may_call(role, method) is allowed


def test_bearer_token_from_metadata() -> None:
    assert bearer_token((("x", "1"), ("authorization", "Bearer abc"))) == "abc"
    assert bearer_token((("authorization", "Basic abc"),)) == ""
    assert bearer_token((("x", "1"),)) is None
    assert bearer_token(None) is None


def test_cli_roles_are_the_token_roles() -> None:
    assert ROLES == TOKEN_ROLES


def _daemon_args(**kw: object) -> argparse.Namespace:
    base = dict(
        tls_ca=None, tls_cert=None, tls_key=None, auth_secret_file=None, auth_token_file=None
    )
    return argparse.Namespace(**{**base, **kw})


def test_daemon_flags_become_config_sections() -> None:
    assert daemon_overrides(_daemon_args()) == {}
    got = daemon_overrides(
        _daemon_args(tls_ca="a", tls_cert="b", tls_key="c", auth_secret_file="s")
    )
    assert got == {
        "tls": {"ca_file": "a", "cert_file": "b", "key_file": "c"},
        "auth": {"secret_file": "s", "token_file": None},
    }
    with pytest.raises(ConfigError, match="give all three"):
        daemon_overrides(_daemon_args(tls_ca="a"))
    with pytest.raises(ConfigError, match="needs --auth-secret-file"):
        daemon_overrides(_daemon_args(auth_token_file="t"))


def test_client_flags_fall_back_to_the_environment(monkeypatch, tmp_path: Path) -> None:
    (tmp_path / "t").write_text("tok\n")
    monkeypatch.setenv("NEUROSHARD_TOKEN_FILE", str(tmp_path / "t"))
    args = argparse.Namespace(coordinator=None)
    assert client_security_of(args).token() == "tok"
    assert client_security_of(argparse.Namespace(token="flag")).token() == "flag"
    monkeypatch.setenv("NEUROSHARD_TLS_CA", "/x")
    with pytest.raises(ConfigError, match="give all three"):
        client_security_of(args)


def test_batch_error_names_the_limit() -> None:
    assert batch_error(10, 10) is None
    assert batch_error(11, 10) == (
        "ids: 11 items exceed max_batch_items 10; split the batch (the Python client does)"
    )


def test_split_parts_keeps_each_slot_in_one_piece() -> None:
    # Arrange: 1000 ids over 16 slots, two owners
    ids = np.arange(1000, dtype=np.uint64) * 7919
    slots = slot_of(ids, 16)
    owner = (slots % 2).astype(np.int64)
    owners = np.array([0, 1], np.int64)
    parts = [np.flatnonzero(owner == w) for w in (0, 1)]

    # Act
    got_owners, pieces = split_parts(owners, parts, 100, lambda p: slot_of(ids[p], 16))

    # Assert: every position once, owners kept, no slot split over pieces, pieces <= limit
    # unless one slot alone holds more
    assert sorted(np.concatenate(pieces).tolist()) == list(range(1000))
    for w, piece in zip(got_owners.tolist(), pieces, strict=True):
        assert set(owner[piece].tolist()) == {w}
        per_slot = np.bincount(slots[piece].astype(np.int64))
        assert len(piece) <= 100 or np.count_nonzero(per_slot) == 1
    seen: dict[int, int] = {}
    for i, piece in enumerate(pieces):
        for s in set(slots[piece].tolist()):
            assert seen.setdefault(s, i) == i, f"slot {s} in two pieces"
        per_slot_positions = piece[slots[piece] == slots[piece][0]]
        assert (np.diff(per_slot_positions) > 0).all(), "batch order kept within a slot"


def test_split_parts_leaves_small_parts_alone() -> None:
    owners, parts = np.array([3], np.int64), [np.arange(5)]
    assert split_parts(owners, parts, 5, lambda p: p)[1] is parts


def test_verified_tokens_are_cached_until_they_expire(monkeypatch) -> None:
    import time

    from shared.auth import AuthInterceptor
    from shared.tokens import TokenError, create_token

    secret = b"k" * 32
    auth = AuthInterceptor(secret, cache_size=2)
    token = create_token(secret, "client", "alice", 60)
    first = auth._verify(token)
    assert auth._verify(token) is first  # from the cache
    with pytest.raises(TokenError, match="signature"):
        auth._verify(token[:-2] + ("AA" if not token.endswith("AA") else "BB"))
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 3600)
    import jwt.api_jwt

    monkeypatch.setattr(jwt.api_jwt, "datetime", _FrozenDatetime(now + 3600))
    with pytest.raises(TokenError, match="expired"):
        auth._verify(token)


class _FrozenDatetime:
    """Stands in for ``datetime`` inside PyJWT so that it sees a later time."""

    def __init__(self, ts: float) -> None:
        import datetime as dt

        self._now = dt.datetime.fromtimestamp(ts, dt.UTC)
        self._dt = dt.datetime

    def now(self, tz: object = None) -> object:
        return self._now

    def __getattr__(self, name: str) -> object:
        return getattr(self._dt, name)
