"""The role table, bearer metadata, the CLI security flags and batch splitting."""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc
import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.cli.security import ROLES, client_security_of, daemon_overrides
from shared.config import ConfigError
from shared.memory.slots import slot_of
from shared.proto import coordinator_pb2
from shared.rpc.limits import batch_error, split_parts
from shared.security.auth import (
    bearer_token,
    bound_name_error,
    may_call,
    may_see_job,
    reset_principal,
    set_principal,
)
from shared.security.tokens import ROLES as TOKEN_ROLES
from shared.security.tokens import Principal

C, W = "/neuroshard.v1.Coordinator/", "/neuroshard.v1.Worker/"
R1A, R1 = "/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/"


@pytest.mark.parametrize(
    ("role", "method", "allowed"),
    [
        ("worker", C + "RegisterWorker", True),
        ("worker", C + "Heartbeat", True),
        ("worker", C + "ReportFailure", True),
        ("worker", C + "DrainWorker", True),
        ("worker", C + "FetchShard", True),
        ("worker", C + "SubmitJob", False),
        ("worker", C + "GetJob", False),
        ("worker", C + "GetClusterStatus", False),
        ("worker", C + "Decay", False),
        ("worker", C + "PutDataset", False),
        ("worker", W + "Replicate", True),
        ("worker", W + "ReceiveSlots", True),
        ("worker", W + "ComputeGradients", True),
        ("worker", W + "Upsert", True),
        ("reader", C + "GetJob", True),
        ("reader", C + "ListJobs", True),
        ("reader", C + "WatchJob", True),
        ("reader", C + "GetClusterStatus", True),
        ("reader", C + "GetSlotMap", True),
        ("reader", C + "Quality", True),
        ("reader", C + "TopK", True),
        ("reader", C + "ListDatasets", True),
        ("reader", W + "Get", True),
        ("reader", C + "SubmitJob", False),
        ("reader", C + "CancelJob", False),
        ("reader", C + "PutDataset", False),
        ("reader", C + "Decay", False),
        ("reader", W + "Upsert", False),
        ("reader", W + "Reinforce", False),
        ("reader", W + "Delete", False),
        ("writer", C + "GetJob", True),
        ("writer", C + "SubmitJob", True),
        ("writer", C + "CancelJob", True),
        ("writer", C + "PutDataset", True),
        ("writer", C + "TopK", True),
        ("writer", W + "Upsert", True),
        ("writer", W + "Reinforce", True),
        ("writer", W + "Delete", True),
        ("writer", W + "Get", True),
        ("writer", C + "Decay", False),
        ("writer", C + "DrainWorker", False),
        ("writer", C + "RegisterWorker", False),
        ("writer", C + "Heartbeat", False),
        ("writer", C + "ReportFailure", True),  # a suspicion: the coordinator only probes
        ("writer", C + "FetchShard", False),
        ("writer", W + "Replicate", False),
        ("writer", W + "Decay", False),
        ("writer", W + "ApplySlotMap", False),
        ("writer", W + "CopySlots", False),
        ("writer", W + "ReceiveSlots", False),
        ("writer", W + "DumpSlots", False),
        ("writer", W + "StartTraining", False),
        ("admin", C + "Decay", True),
        ("admin", C + "DrainWorker", True),
        ("admin", W + "DumpSlots", True),
        ("reader", C + "ExportMemories", True),  # memory export
        ("writer", C + "ExportMemories", True),
        ("admin", C + "ExportMemories", True),
        ("worker", C + "ExportMemories", False),
        ("admin", C + "ForgetWorker", True),  # forget-worker: admin only
        ("writer", C + "ForgetWorker", False),
        ("reader", C + "ForgetWorker", False),
        ("worker", C + "ForgetWorker", False),
        ("admin", C + "Sweep", True),  # a sweep decays the whole store: admin, like Decay
        ("writer", C + "Sweep", False),
        ("reader", C + "Sweep", False),
        ("worker", C + "Sweep", False),
        ("worker", W + "Sweep", True),
        ("client", C + "GetJob", False),  # the old role is no role
        ("reader", "/grpc.health.v1.Health/Check", True),
        ("reader", R1A + "ServerReflectionInfo", True),
        ("reader", R1 + "ServerReflectionInfo", True),
        ("writer", R1A + "ServerReflectionInfo", True),
        ("admin", R1A + "ServerReflectionInfo", True),
        ("worker", R1A + "ServerReflectionInfo", False),  # daemons never need it
        ("client", R1A + "ServerReflectionInfo", False),
        ("reader", "/grpc.reflection.v1alpha.Other/ServerReflectionInfo", False),
        ("writer", "/other.Service/Call", False),
        ("writer", "/neuroshard.v1.CoordinatorX/GetJob", False),
    ],
)
def test_role_table(role: str, method: str, allowed: bool) -> None:
    assert may_call(role, method) is allowed


@pytest.mark.parametrize(
    ("method", "message", "denied"),
    [
        ("RegisterWorker", coordinator_pb2.RegisterWorkerRequest(name="w0"), False),
        ("RegisterWorker", coordinator_pb2.RegisterWorkerRequest(name="worker-1"), True),
        ("RegisterWorker", coordinator_pb2.RegisterWorkerRequest(), True),
        ("Heartbeat", coordinator_pb2.HeartbeatRequest(name="worker-1"), True),
        ("ReportFailure", coordinator_pb2.ReportFailureRequest(reporter="w0", worker="x"), False),
        ("ReportFailure", coordinator_pb2.ReportFailureRequest(reporter="x", worker="w0"), True),
        ("DrainWorker", coordinator_pb2.DrainWorkerRequest(name="worker-1"), True),
        ("FetchShard", coordinator_pb2.FetchShardRequest(worker="worker-1"), True),
        ("GetJob", coordinator_pb2.JobRequest(job_id="w0"), False),  # not bound
    ],
)
def test_worker_requests_are_bound_to_the_token(method: str, message: object, denied: bool) -> None:
    w0 = Principal("w0", "worker", 0.0)
    error = bound_name_error(w0, method, message)
    assert (error is not None) is denied
    if denied:
        assert error is not None and error.startswith(f"{method}: the worker token of 'w0'")
    admin = Principal("root", "admin", 0.0)
    assert bound_name_error(admin, method, message) is None  # admin may act for any worker


def test_a_name_pattern_token_covers_matching_names_only() -> None:
    pool = Principal("pool", "worker", 0.0, "neuroshard-worker-*")
    ok = coordinator_pb2.RegisterWorkerRequest(name="neuroshard-worker-2")
    bad = coordinator_pb2.RegisterWorkerRequest(name="neuroshard-coordinator")
    assert bound_name_error(pool, "RegisterWorker", ok) is None
    assert bound_name_error(pool, "RegisterWorker", bad) == (
        "RegisterWorker: the worker token of 'pool' (names 'neuroshard-worker-*') may not act "
        "as name 'neuroshard-coordinator'"
    )


def test_job_visibility_follows_the_subject() -> None:
    cases = [(None, "alice", True), (Principal("root", "admin", 0.0), "alice", True)]
    cases += [(Principal("alice", "writer", 0.0), "alice", True)]
    cases += [(Principal("bob", "writer", 0.0), "alice", False)]
    cases += [(Principal("bob", "reader", 0.0), "", False)]
    for principal, owner, visible in cases:
        token = set_principal(principal)
        try:
            assert may_see_job(owner) is visible, (principal, owner)
        finally:
            reset_principal(token)


def test_bearer_token_from_metadata() -> None:
    assert bearer_token((("x", "1"), ("authorization", "Bearer abc"))) == "abc"
    assert bearer_token((("authorization", "Basic abc"),)) == ""
    assert bearer_token((("x", "1"),)) is None
    assert bearer_token(None) is None


def test_cli_roles_are_the_token_roles() -> None:
    assert ROLES == TOKEN_ROLES


def _daemon_args(**kw: object) -> argparse.Namespace:
    base = dict(
        tls_ca=None,
        tls_cert=None,
        tls_key=None,
        auth_public_key_file=None,
        auth_private_key_file=None,
        auth_token_file=None,
    )
    return argparse.Namespace(**{**base, **kw})


def test_daemon_flags_become_config_sections() -> None:
    assert daemon_overrides(_daemon_args()) == {}
    got = daemon_overrides(
        _daemon_args(tls_ca="a", tls_cert="b", tls_key="c", auth_public_key_file="p")
    )
    assert got == {
        "tls": {"ca_file": "a", "cert_file": "b", "key_file": "c"},
        "auth": {"public_key_file": "p", "private_key_file": None, "token_file": None},
    }
    worker = daemon_overrides(_daemon_args(auth_public_key_file="p", auth_token_file="t"))
    assert worker["auth"]["token_file"] == "t"
    with pytest.raises(ConfigError, match="give all three"):
        daemon_overrides(_daemon_args(tls_ca="a"))
    with pytest.raises(ConfigError, match="^--auth-token-file: needs --auth-public-key-file"):
        daemon_overrides(_daemon_args(auth_token_file="t"))
    with pytest.raises(ConfigError, match="^--auth-private-key-file: needs"):
        daemon_overrides(_daemon_args(auth_private_key_file="k"))


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

    from shared.rpc.interceptors import AuthInterceptor
    from shared.security.tokens import TokenError, create_token

    key = Ed25519PrivateKey.generate()
    auth = AuthInterceptor(key.public_key(), cache_size=2)
    token = create_token(key, "writer", "alice", 60)
    first = auth._verify(token)
    assert auth._verify(token) is first  # from the cache
    # Another character inside the signature (its last ones also carry base64 padding bits)
    i = len(token) - 10
    tampered = token[:i] + ("A" if token[i] != "A" else "B") + token[i + 1 :]
    with pytest.raises(TokenError, match="signature is invalid"):
        auth._verify(tampered)
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


class _Details:
    """A ``grpc.HandlerCallDetails`` stand-in."""

    def __init__(self, method: str, token: str | None) -> None:
        self.method = method
        self.invocation_metadata = (("authorization", f"Bearer {token}"),) if token else ()


def _explode(data: bytes) -> object:
    raise AssertionError("the request was deserialized")


@pytest.mark.parametrize(
    "make",
    [
        grpc.unary_unary_rpc_method_handler,
        grpc.unary_stream_rpc_method_handler,
        grpc.stream_unary_rpc_method_handler,
        grpc.stream_stream_rpc_method_handler,
    ],
)
@pytest.mark.parametrize(
    ("role", "code"),
    [(None, grpc.StatusCode.UNAUTHENTICATED), ("reader", grpc.StatusCode.PERMISSION_DENIED)],
)
async def test_a_refused_call_gets_a_handler_that_parses_nothing(make, role, code) -> None:
    # Arrange: a servicer handler whose deserializer and behavior must never run
    from shared.rpc.interceptors import AuthInterceptor
    from shared.security.tokens import create_token

    key = Ed25519PrivateKey.generate()
    token = create_token(key, role, "r", 60) if role else None

    async def behavior(request: object, context: object) -> None:
        raise AssertionError("the servicer ran")

    original = make(behavior, request_deserializer=_explode)

    async def continuation(details: object) -> grpc.RpcMethodHandler:
        return original

    # Act
    got = await AuthInterceptor(key.public_key()).intercept_service(
        continuation, _Details(W + "Replicate", token)
    )

    # Assert: same kind, no deserializer, a behavior that aborts with the refusal
    kinds = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
    assert [getattr(got, k) is not None for k in kinds] == [
        getattr(original, k) is not None for k in kinds
    ]
    assert got.request_deserializer is None and got.request_streaming == original.request_streaming

    class _Aborted(Exception):
        pass

    class _Context:
        async def abort(self, c: grpc.StatusCode, message: str) -> None:
            raise _Aborted(c, message)

    behavior_of = next(getattr(got, k) for k in kinds if getattr(got, k) is not None)
    with pytest.raises(_Aborted) as info:
        await behavior_of(b"\xff garbage", _Context())
    assert info.value.args[0] is code
