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
    address_error,
    bearer_token,
    bound_name_error,
    may_call,
    may_see_job,
    reset_principal,
    set_principal,
)
from shared.security.tokens import AUD_COORDINATOR, AUD_DATA, Principal
from shared.security.tokens import ROLES as TOKEN_ROLES

C, W = "/neuroshard.v1.Coordinator/", "/neuroshard.v1.Worker/"
R1A, R1 = "/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/"
INF = float("inf")


def _caller(kind: str) -> Principal:
    """A principal by short name: ``worker`` and ``coordinator`` are certificates' (no
    audience), ``reader``/``writer``/``admin`` coordinator tokens', ``data-ROLE`` data-plane
    tokens'; ``client`` is the role of old, which no token may carry."""
    if kind == "worker":
        return Principal("w0", "worker", INF, hosts=("localhost",))
    if kind == "coordinator":
        return Principal("coordinator", "coordinator", INF)
    if kind.startswith("data-"):
        return Principal("alice", kind.removeprefix("data-"), INF, AUD_DATA, "j")
    return Principal("alice", kind, INF, AUD_COORDINATOR, "j")


ALL_COORDINATOR = (
    "RegisterWorker",
    "Heartbeat",
    "ReportFailure",
    "DrainWorker",
    "FetchShard",
    "SubmitJob",
    "GetJob",
    "ListJobs",
    "WatchJob",
    "CancelJob",
    "RunEpochs",
    "FinishJob",
    "GetClusterStatus",
    "GetSlotMap",
    "Quality",
    "TopK",
    "Sample",
    "Decay",
    "Sweep",
    "PutDataset",
    "ListDatasets",
    "ExportMemories",
    "ForgetWorker",
    "GetModel",
    "ListModels",
)
WORKER_CONTROL = (
    "ApplySlotMap",
    "CopySlots",
    "Decay",
    "Sweep",
    "Quality",
    "TopK",
    "SampleSums",
    "SamplePick",
    "StartTraining",
    "RunAllreduce",
    "ComputeGradients",
    "StopTraining",
)
WORKER_PEER = ("Replicate", "ReceiveSlots", "DumpSlots", "SlotSeqs")
KEYED = ("Get", "Upsert", "Reinforce", "Delete")
ALL_WORKER = WORKER_CONTROL + WORKER_PEER + KEYED


@pytest.mark.parametrize(
    ("caller", "method", "allowed"),
    [
        # A worker's certificate: its own few Coordinator RPCs, and the peer RPCs on workers.
        ("worker", C + "RegisterWorker", True),
        ("worker", C + "Heartbeat", True),
        ("worker", C + "ReportFailure", True),
        ("worker", C + "DrainWorker", True),
        ("worker", C + "FetchShard", True),
        ("worker", C + "SubmitJob", False),
        ("worker", C + "GetJob", False),
        ("worker", C + "ListJobs", False),
        ("worker", C + "GetClusterStatus", False),
        ("worker", C + "GetSlotMap", False),
        ("worker", C + "Decay", False),
        ("worker", C + "PutDataset", False),
        ("worker", C + "ExportMemories", False),
        ("worker", C + "ForgetWorker", False),
        ("worker", C + "Sweep", False),
        ("worker", W + "Replicate", True),
        ("worker", W + "ReceiveSlots", True),
        ("worker", W + "DumpSlots", True),
        ("worker", W + "SlotSeqs", True),
        # ... but never the coordinator's control RPCs, nor a client's keyed ones
        ("worker", W + "ApplySlotMap", False),
        ("worker", W + "CopySlots", False),
        ("worker", W + "Decay", False),
        ("worker", W + "Sweep", False),
        ("worker", W + "StartTraining", False),
        ("worker", W + "RunAllreduce", False),
        ("worker", W + "ComputeGradients", False),
        ("worker", W + "StopTraining", False),
        ("worker", W + "Upsert", False),
        ("worker", W + "Get", False),
        ("worker", W + "Delete", False),
        # The coordinator's certificate: no Coordinator RPC at all (a stolen coordinator
        # identity is no admin), the workers' control RPCs, inspections and keyed calls.
        ("coordinator", C + "GetJob", False),
        ("coordinator", C + "SubmitJob", False),
        ("coordinator", C + "Decay", False),
        ("coordinator", C + "DrainWorker", False),
        ("coordinator", C + "ForgetWorker", False),
        ("coordinator", C + "RegisterWorker", False),
        ("coordinator", C + "Heartbeat", False),
        ("coordinator", C + "GetSlotMap", False),
        ("coordinator", C + "ExportMemories", False),
        ("coordinator", W + "ApplySlotMap", True),
        ("coordinator", W + "CopySlots", True),
        ("coordinator", W + "Decay", True),
        ("coordinator", W + "StartTraining", True),
        ("coordinator", W + "ComputeGradients", True),
        ("coordinator", W + "DumpSlots", True),
        ("coordinator", W + "SlotSeqs", True),
        ("coordinator", W + "Upsert", True),
        ("coordinator", W + "Get", True),
        ("coordinator", W + "Replicate", False),
        ("coordinator", W + "ReceiveSlots", False),
        # People's coordinator tokens: the Coordinator service only.
        ("reader", C + "GetJob", True),
        ("reader", C + "ListJobs", True),
        ("reader", C + "WatchJob", True),
        ("reader", C + "GetClusterStatus", True),
        ("reader", C + "GetSlotMap", True),
        ("reader", C + "Quality", True),
        ("reader", C + "TopK", True),
        ("reader", C + "Sample", True),
        ("data-writer", W + "SamplePick", True),  # the client draws through the primaries
        ("data-writer", W + "CopySlots", False),
        ("reader", C + "ListDatasets", True),
        ("reader", C + "ReportFailure", True),  # a suspicion: the coordinator only probes
        ("reader", C + "SubmitJob", False),
        ("reader", C + "CancelJob", False),
        ("reader", C + "RunEpochs", False),  # a paced job's grants: writers (their own)
        ("reader", C + "FinishJob", False),
        ("reader", C + "PutDataset", False),
        ("reader", C + "Decay", False),
        ("reader", C + "RegisterWorker", False),
        ("reader", W + "Get", False),  # workers see data-plane tokens only
        ("reader", W + "Upsert", False),
        ("writer", C + "GetJob", True),
        ("writer", C + "SubmitJob", True),
        ("writer", C + "CancelJob", True),
        ("writer", C + "RunEpochs", True),
        ("writer", C + "FinishJob", True),
        ("writer", C + "PutDataset", True),
        ("writer", C + "TopK", True),
        ("writer", C + "ReportFailure", True),
        ("writer", C + "Decay", False),
        ("writer", C + "DrainWorker", False),
        ("writer", C + "RegisterWorker", False),
        ("writer", C + "Heartbeat", False),
        ("writer", C + "FetchShard", False),
        ("writer", W + "Get", False),
        ("writer", W + "Upsert", False),
        ("writer", W + "Reinforce", False),
        ("writer", W + "Delete", False),
        ("writer", W + "Replicate", False),
        ("writer", W + "Decay", False),
        ("writer", W + "ApplySlotMap", False),
        ("writer", W + "CopySlots", False),
        ("writer", W + "ReceiveSlots", False),
        ("writer", W + "DumpSlots", False),
        ("writer", W + "StartTraining", False),
        ("admin", C + "Decay", True),
        ("admin", C + "DrainWorker", True),
        ("admin", C + "ForgetWorker", True),  # forget-worker: admin only
        ("admin", C + "Sweep", True),  # a sweep decays the whole store: admin, like Decay
        ("admin", C + "ExportMemories", True),
        ("admin", W + "DumpSlots", False),  # an admin's token reaches no worker
        ("admin", W + "Decay", False),
        ("admin", W + "ApplySlotMap", False),
        ("admin", W + "Upsert", False),
        ("reader", C + "ExportMemories", True),  # memory export
        ("admin", C + "CreateTable", True),  # tables: admin creates and drops, anyone lists
        ("admin", C + "DropTable", True),
        ("writer", C + "CreateTable", False),
        ("writer", C + "DropTable", False),
        ("reader", C + "CreateTable", False),
        ("reader", C + "ListTables", True),
        ("writer", C + "ListTables", True),
        ("worker", C + "ListTables", False),
        ("writer", C + "ExportMemories", True),
        ("reader", C + "GetModel", True),  # a model of one's own job (servicer: may_see_job)
        ("reader", C + "ListModels", True),
        ("worker", C + "GetModel", False),
        ("coordinator", C + "GetModel", False),
        ("writer", C + "ForgetWorker", False),
        ("reader", C + "ForgetWorker", False),
        ("writer", C + "Sweep", False),
        ("reader", C + "Sweep", False),
        # Data-plane tokens: the keyed Worker RPCs only, by role; nothing on the coordinator.
        ("data-reader", W + "Get", True),
        ("data-reader", W + "Upsert", False),
        ("data-reader", W + "Reinforce", False),
        ("data-reader", W + "Delete", False),
        ("data-reader", W + "DumpSlots", False),
        ("data-reader", C + "GetJob", False),
        ("data-reader", C + "GetSlotMap", False),
        ("data-writer", W + "Get", True),
        ("data-writer", W + "Upsert", True),
        ("data-writer", W + "Reinforce", True),
        ("data-writer", W + "Delete", True),
        ("data-writer", W + "Replicate", False),
        ("data-writer", W + "ReceiveSlots", False),
        ("data-writer", W + "DumpSlots", False),
        ("data-writer", W + "SlotSeqs", False),
        ("data-writer", W + "Decay", False),
        ("data-writer", W + "Sweep", False),
        ("data-writer", W + "ApplySlotMap", False),
        ("data-writer", C + "GetJob", False),
        ("data-writer", C + "SubmitJob", False),
        ("data-admin", W + "Upsert", True),  # an admin's data-plane token is a writer's
        ("data-admin", W + "Decay", False),
        ("data-admin", W + "DumpSlots", False),
        ("data-admin", C + "Decay", False),
        ("data-admin", C + "GetJob", False),
        ("client", C + "GetJob", False),  # the old role is no role
        ("client", W + "Get", False),
        # Health is open; reflection is for people, with a token of the daemon's audience.
        ("reader", "/grpc.health.v1.Health/Check", True),
        ("coordinator", "/grpc.health.v1.Health/Check", True),
        ("data-reader", "/grpc.health.v1.Health/Watch", True),
        ("reader", R1A + "ServerReflectionInfo", True),
        ("reader", R1 + "ServerReflectionInfo", True),
        ("writer", R1A + "ServerReflectionInfo", True),
        ("admin", R1A + "ServerReflectionInfo", True),
        ("worker", R1A + "ServerReflectionInfo", False),  # daemons never need it
        ("coordinator", R1 + "ServerReflectionInfo", False),
        ("data-writer", R1A + "ServerReflectionInfo", True),  # on a worker, its audience
        ("client", R1A + "ServerReflectionInfo", False),
        ("reader", "/grpc.reflection.v1alpha.Other/ServerReflectionInfo", False),
        ("writer", "/other.Service/Call", False),
        ("admin", "/other.Service/Call", False),
        ("coordinator", "/other.Service/Call", False),
        ("writer", "/neuroshard.v1.CoordinatorX/GetJob", False),
        ("admin", "/neuroshard.v1.CoordinatorX/GetJob", False),
        ("data-writer", "/neuroshard.v1.WorkerX/Upsert", False),
    ],
)
def test_role_table(caller: str, method: str, allowed: bool) -> None:
    assert may_call(_caller(caller), method) is allowed


def test_the_coordinator_identity_may_call_no_coordinator_rpc() -> None:
    coordinator = _caller("coordinator")
    assert not [m for m in ALL_COORDINATOR if may_call(coordinator, C + m)]
    allowed = {m for m in ALL_WORKER if may_call(coordinator, W + m)}
    assert allowed == set(WORKER_CONTROL) | {"DumpSlots", "SlotSeqs"} | set(KEYED)


def test_the_worker_service_is_split_by_caller() -> None:
    def allowed(kind: str) -> set[str]:
        return {m for m in ALL_WORKER if may_call(_caller(kind), W + m)}

    assert allowed("worker") == set(WORKER_PEER)
    # The client's own fan-out of the coordinator's Quality, TopK and Sample
    reads = {"Quality", "TopK", "SampleSums", "SamplePick"}
    assert allowed("data-reader") == {"Get"} | reads
    assert allowed("data-writer") == allowed("data-admin") == set(KEYED) | reads
    for kind in ("reader", "writer", "admin", "client"):
        assert allowed(kind) == set(), kind


def test_tokens_reach_only_the_daemon_of_their_audience() -> None:
    for role in ("reader", "writer", "admin"):
        data = _caller(f"data-{role}")
        assert not [m for m in ALL_COORDINATOR if may_call(data, C + m)], role
    admin = _caller("admin")
    assert all(may_call(admin, C + m) for m in ALL_COORDINATOR)


@pytest.mark.parametrize(
    "principal",
    [
        Principal("w0", "worker", INF, AUD_COORDINATOR),  # a daemon role with an audience
        Principal("w0", "worker", INF, AUD_DATA),
        Principal("alice", "admin", INF),  # a token role without an audience
        Principal("alice", "reader", INF, "elsewhere"),
    ],
    ids=["worker+coordinator aud", "worker+data aud", "admin without aud", "foreign aud"],
)
def test_a_role_in_the_wrong_audience_may_call_nothing(principal: Principal) -> None:
    calls = [C + m for m in ALL_COORDINATOR] + [W + m for m in ALL_WORKER]
    assert not [m for m in calls if may_call(principal, m)]


@pytest.mark.parametrize(
    ("method", "message", "denied"),
    [
        ("RegisterWorker", coordinator_pb2.RegisterWorkerRequest(name="w0"), None),
        (
            "RegisterWorker",
            coordinator_pb2.RegisterWorkerRequest(name="worker-1"),
            "name 'worker-1'",
        ),
        ("RegisterWorker", coordinator_pb2.RegisterWorkerRequest(), "name ''"),
        ("RegisterWorker", coordinator_pb2.RegisterWorkerRequest(name="W0"), "name 'W0'"),
        ("Heartbeat", coordinator_pb2.HeartbeatRequest(name="w0"), None),
        ("Heartbeat", coordinator_pb2.HeartbeatRequest(name="worker-1"), "name 'worker-1'"),
        ("ReportFailure", coordinator_pb2.ReportFailureRequest(reporter="w0", worker="x"), None),
        (
            "ReportFailure",
            coordinator_pb2.ReportFailureRequest(reporter="x", worker="w0"),
            "reporter 'x'",
        ),
        ("DrainWorker", coordinator_pb2.DrainWorkerRequest(name="w0"), None),
        ("DrainWorker", coordinator_pb2.DrainWorkerRequest(name="worker-1"), "name 'worker-1'"),
        ("FetchShard", coordinator_pb2.FetchShardRequest(worker="w0"), None),
        ("FetchShard", coordinator_pb2.FetchShardRequest(worker="worker-1"), "worker 'worker-1'"),
        ("GetJob", coordinator_pb2.JobRequest(job_id="w0"), None),  # not bound
    ],
)
def test_worker_requests_are_bound_to_the_certificates_name(
    method: str, message: object, denied: str | None
) -> None:
    # A worker's certificate names it: it may act as that name only (another worker's name is
    # what a stolen worker token used to allow).
    w0 = _caller("worker")
    error = bound_name_error(w0, method, message)
    if denied is None:
        assert error is None
    else:
        assert error == f"{method}: worker 'w0' (by its certificate) may not act as {denied}"
    admin = _caller("admin")
    assert bound_name_error(admin, method, message) is None  # admin may act for any worker


@pytest.mark.parametrize(
    ("hosts", "address", "ok"),
    [
        (("localhost", "127.0.0.1"), "127.0.0.1:5000", True),
        (("localhost", "127.0.0.1"), "localhost:5000", True),
        (("localhost", "127.0.0.1"), "LOCALHOST:5000", True),
        (("localhost", "127.0.0.1"), "10.0.0.7:5000", False),
        (("localhost", "127.0.0.1"), "worker-1.svc:5000", False),
        (("localhost", "127.0.0.1"), "127.0.0.2:5000", False),
        (("*.workers.svc",), "w0.workers.svc:1", True),
        (("*.workers.svc",), "a.w0.workers.svc:1", False),  # a wildcard is one label
        (("*.workers.svc",), "workers.svc:1", False),
        (("::1",), "[::1]:5000", True),
        (("::1",), "[0:0::1]:5000", True),  # compared as addresses
        (("127.0.0.1",), "[::1]:5000", False),
        ((), "127.0.0.1:5000", False),
    ],
)
def test_a_worker_registers_only_an_address_its_certificate_names(
    hosts: tuple[str, ...], address: str, ok: bool
) -> None:
    worker = Principal("w0", "worker", INF, hosts=hosts)
    error = address_error(worker, address)
    if ok:
        assert error is None
    else:
        host = address.rpartition(":")[0]
        assert error == (
            f"RegisterWorker: address {address!r}: host {host!r} is not among the names of "
            f"worker 'w0''s certificate ({', '.join(hosts) or 'none'})"
        )


def test_only_workers_have_their_address_checked() -> None:
    assert address_error(None, "anywhere:1") is None  # auth off
    assert address_error(_caller("admin"), "anywhere:1") is None


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
        auth_revoked_file=None,
    )
    return argparse.Namespace(**{**base, **kw})


def test_daemon_flags_become_config_sections() -> None:
    assert daemon_overrides(_daemon_args()) == {}
    got = daemon_overrides(
        _daemon_args(tls_ca="a", tls_cert="b", tls_key="c", auth_public_key_file="p")
    )
    assert got == {
        "tls": {"ca_file": "a", "cert_file": "b", "key_file": "c"},
        "auth": {"public_key_file": "p", "private_key_file": None, "revoked_file": None},
    }
    coordinator = daemon_overrides(
        _daemon_args(auth_public_key_file="p", auth_private_key_file="k", auth_revoked_file="r")
    )
    assert coordinator["auth"] == {
        "public_key_file": "p",
        "private_key_file": "k",
        "revoked_file": "r",
    }
    with pytest.raises(ConfigError, match="give all three"):
        daemon_overrides(_daemon_args(tls_ca="a"))
    with pytest.raises(ConfigError, match="^--auth-revoked-file: needs --auth-public-key-file"):
        daemon_overrides(_daemon_args(auth_revoked_file="r"))
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
    assert first.audience == "neuroshard" and first.token_id
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


def test_a_cached_token_is_refused_once_revoked(tmp_path: Path) -> None:
    from shared.rpc.interceptors import AuthInterceptor
    from shared.security.tokens import RevocationList, TokenError, create_token, token_id

    key = Ed25519PrivateKey.generate()
    revoked = tmp_path / "revoked"
    auth = AuthInterceptor(key.public_key(), revoked=RevocationList(revoked, 0.0))
    token = create_token(key, "admin", "root", 60)
    assert auth._verify(token).subject == "root"  # now cached
    revoked.write_text(f"# leaked\n{token_id(token)}\n")
    with pytest.raises(TokenError, match=f"^token {token_id(token)} is revoked$"):
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
    ("token_of", "method", "audience", "code", "message"),
    [
        # no token on a server without TLS (no certificate can name a daemon)
        (None, W + "Replicate", AUD_DATA, grpc.StatusCode.UNAUTHENTICATED, "missing bearer token"),
        # a person's coordinator token at a worker: its audience is wrong there
        (
            ("admin", AUD_COORDINATOR),
            W + "Replicate",
            AUD_DATA,
            grpc.StatusCode.UNAUTHENTICATED,
            "token is not for this daemon (audience 'neuroshard', expected 'neuroshard-data')",
        ),
        # a data-plane token (what a worker sees) replayed to the coordinator
        (
            ("writer", AUD_DATA),
            C + "SubmitJob",
            AUD_COORDINATOR,
            grpc.StatusCode.UNAUTHENTICATED,
            "token is not for this daemon (audience 'neuroshard-data', expected 'neuroshard')",
        ),
        # right audience, wrong method
        (
            ("reader", AUD_DATA),
            W + "Upsert",
            AUD_DATA,
            grpc.StatusCode.PERMISSION_DENIED,
            "reader 'r' may not call Upsert",
        ),
        (
            ("writer", AUD_DATA),
            W + "Replicate",
            AUD_DATA,
            grpc.StatusCode.PERMISSION_DENIED,
            "writer 'r' may not call Replicate",
        ),
        (
            ("reader", AUD_COORDINATOR),
            C + "Decay",
            AUD_COORDINATOR,
            grpc.StatusCode.PERMISSION_DENIED,
            "reader 'r' may not call Decay",
        ),
    ],
    ids=[
        "no token",
        "coordinator token at a worker",
        "data token at the coordinator",
        "data reader writes",
        "data writer replicates",
        "reader decays",
    ],
)
async def test_a_refused_call_gets_a_handler_that_parses_nothing(
    make, token_of, method, audience, code, message
) -> None:
    # Arrange: a servicer handler whose deserializer and behavior must never run
    from shared.rpc.interceptors import AuthInterceptor
    from shared.security.tokens import create_token

    key = Ed25519PrivateKey.generate()
    token = create_token(key, token_of[0], "r", 60, audience=token_of[1]) if token_of else None

    async def behavior(request: object, context: object) -> None:
        raise AssertionError("the servicer ran")

    original = make(behavior, request_deserializer=_explode)

    async def continuation(details: object) -> grpc.RpcMethodHandler:
        return original

    # Act: token calls are decided from the metadata (on a TLS server too); a call without a
    # token is refused here only without TLS (with it, the certificate decides, per call)
    interceptor = AuthInterceptor(key.public_key(), audience, tls=token is not None)
    got = await interceptor.intercept_service(continuation, _Details(method, token))

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
    assert info.value.args[1].startswith(message)


class _TlsContext:
    """A server context whose auth context holds the peer's certificate, as gRPC's does."""

    def __init__(self, pem: bytes | None) -> None:
        self._pem = pem

    def auth_context(self) -> dict[str, list[bytes]]:
        return {"x509_pem_cert": [self._pem]} if self._pem else {}


@pytest.fixture(scope="module")
def dev_certs(tmp_path_factory: pytest.TempPathFactory):
    from shared.security.certs import write_dev_certs

    return write_dev_certs(tmp_path_factory.mktemp("certs"), ["node.example"], ["w0"])


@pytest.mark.parametrize(
    ("whose", "method", "who", "message"),
    [
        ("w0", W + "Replicate", ("w0", "worker"), ""),
        ("w0", C + "Heartbeat", ("w0", "worker"), ""),
        ("w0", W + "Decay", None, "worker 'w0' may not call Decay"),
        ("w0", W + "Upsert", None, "worker 'w0' may not call Upsert"),
        ("w0", C + "GetJob", None, "worker 'w0' may not call GetJob"),
        ("coordinator", W + "ApplySlotMap", ("coordinator", "coordinator"), ""),
        ("coordinator", C + "GetJob", None, "coordinator 'coordinator' may not call GetJob"),
        ("coordinator", W + "Replicate", None, "coordinator 'coordinator' may not call Replicate"),
        ("client", W + "Replicate", None, "missing bearer token"),
        ("client", C + "GetJob", None, "missing bearer token"),
        (None, C + "GetJob", None, "missing bearer token"),
    ],
)
def test_a_call_without_a_token_is_the_certificates(
    dev_certs, whose: str | None, method: str, who: tuple[str, str] | None, message: str
) -> None:
    # Arrange
    from shared.rpc.interceptors import AuthInterceptor

    pem = {
        "w0": dev_certs.worker("w0")[0],
        "coordinator": dev_certs.coordinator_cert,
        "client": dev_certs.client_cert,
    }
    context = _TlsContext(pem[whose].read_bytes() if whose else None)
    auth = AuthInterceptor(Ed25519PrivateKey.generate().public_key())

    # Act
    principal, _, refused = auth._daemon(context, method)

    # Assert
    if who is None:
        assert principal is None and refused.startswith(message)
    else:
        assert principal is not None and (principal.subject, principal.role) == who
        assert principal.is_daemon and principal.audience == "" and refused == ""
        assert "node.example" in principal.hosts and "127.0.0.1" in principal.hosts


async def test_a_wrapped_handler_is_reused_per_caller_never_across_callers() -> None:
    # Arrange: two writers' data tokens and one servicer handler that reports its caller
    import asyncio

    from shared.rpc.interceptors import AuthInterceptor
    from shared.security.auth import current_principal
    from shared.security.tokens import create_token

    key = Ed25519PrivateKey.generate()
    alice = create_token(key, "writer", "alice", 60, audience=AUD_DATA)
    bob = create_token(key, "writer", "bob", 60, audience=AUD_DATA)

    async def behavior(request: object, context: object) -> str:
        caller = current_principal()
        return caller.subject if caller else ""

    original = grpc.unary_unary_rpc_method_handler(behavior)

    async def continuation(details: object) -> grpc.RpcMethodHandler:
        return original

    interceptor = AuthInterceptor(key.public_key(), AUD_DATA, tls=False)

    async def call(token: str) -> tuple[object, str]:
        handler = await interceptor.intercept_service(continuation, _Details(W + "Get", token))
        # each RPC runs in its own task, as grpc.aio's
        return handler, await asyncio.create_task(handler.unary_unary(b"", object()))

    # Act
    a1, a2, b1, a3 = [await call(t) for t in (alice, alice, bob, alice)]

    # Assert: the same wrapper for one caller's calls; each call runs as its own caller
    assert a1[0] is a2[0]
    assert b1[0] is not a1[0] and a3[0] is not b1[0]
    assert [x[1] for x in (a1, a2, b1, a3)] == ["alice", "alice", "bob", "alice"]


def test_the_token_cache_drops_the_least_recently_used() -> None:
    from shared.rpc.interceptors import AuthInterceptor
    from shared.security.tokens import create_token

    key = Ed25519PrivateKey.generate()
    auth = AuthInterceptor(key.public_key(), cache_size=2)
    a, b, c = (create_token(key, "reader", name, 60) for name in "abc")

    first = auth._verify(a)
    auth._verify(b)
    assert auth._verify(a) is first  # a is now the most recently used
    auth._verify(c)

    assert list(auth._verified) == [a, c]


async def test_the_chain_is_one_interceptor_that_refuses_as_its_layers() -> None:
    # Arrange: a worker's chain with auth (no TLS: every call needs a token), a limit of 2 ids
    from shared.metrics import Metrics
    from shared.proto import worker_pb2
    from shared.rpc.interceptors import AuthInterceptor, ChainInterceptor, server_interceptors
    from shared.security.auth import current_principal
    from shared.security.tokens import create_token

    key = Ed25519PrivateKey.generate()
    auth = AuthInterceptor(key.public_key(), AUD_DATA, tls=False)
    chain = server_interceptors(Metrics(), auth, worker_name="w0", max_batch_items=2)
    reader = create_token(key, "reader", "r", 60, audience=AUD_DATA)
    callers: list[object] = []

    async def behavior(request: worker_pb2.GetRequest, context: object) -> worker_pb2.GetResponse:
        callers.append(current_principal())
        return worker_pb2.GetResponse()

    def handler_of(deser) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            behavior,
            request_deserializer=deser,
            response_serializer=worker_pb2.GetResponse.SerializeToString,
        )

    original = handler_of(worker_pb2.GetRequest.FromString)

    async def continuation(details: object) -> grpc.RpcMethodHandler:
        return original

    class _Aborted(Exception):
        pass

    class _Context:
        def __init__(self) -> None:
            self._code: grpc.StatusCode | None = None

        async def abort(self, c: grpc.StatusCode, message: str) -> None:
            self._code = c
            raise _Aborted(c, message)

        def code(self) -> grpc.StatusCode | None:
            return self._code

        def peer(self) -> str:
            return "ipv4:127.0.0.1:1"

    async def call(method: str, token: str | None, ids: int) -> object:
        got = await chain[0].intercept_service(continuation, _Details(method, token))
        raw = worker_pb2.GetRequest(ids=np.arange(ids, dtype="<u8").tobytes())
        data = raw.SerializeToString()
        request = got.request_deserializer(data) if got.request_deserializer else data
        try:
            return await got.unary_unary(request, _Context())
        except _Aborted as exc:
            return exc.args[0]

    # Act
    refused = await call(W + "Upsert", reader, 1)
    anonymous = await call(W + "Get", None, 1)
    too_many = await call(W + "Get", reader, 3)
    served = await call(W + "Get", reader, 2)

    # Assert
    assert len(chain) == 1 and isinstance(chain[0], ChainInterceptor)
    assert refused is grpc.StatusCode.PERMISSION_DENIED
    assert anonymous is grpc.StatusCode.UNAUTHENTICATED
    assert too_many is grpc.StatusCode.INVALID_ARGUMENT
    assert isinstance(served, worker_pb2.GetResponse)
    assert [(p.subject, p.role) for p in callers] == [("r", "reader")]  # type: ignore[attr-defined]
