"""Typed configuration: daemon configs and job specs, loaded from YAML and validated.

Every model forbids unknown keys; a validation error is turned into one line that names the
field (``ConfigError``), which the CLI prints and the coordinator returns as INVALID_ARGUMENT.
Every field has a default and a description with its unit; ``shared.config_doc`` prints the
reference tables of the README from them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

T = TypeVar("T", bound=BaseModel)


# Markers of spec fields that name code or files: ``shared.security.confinement`` finds and
# checks every data path, ``shared.training.entry_points.check_entries`` every entry point (with
# the config table named by ENTRY_TABLE_KEY), so a new such field cannot be forgotten.
TRUST_KEY = "neuroshard_trust"
ENTRY_TABLE_KEY = "neuroshard_entry_table"
DATA_PATH_REF: dict[str, Any] = {TRUST_KEY: "data_path"}
MODEL_ENTRY_REF: dict[str, Any] = {TRUST_KEY: "entry", ENTRY_TABLE_KEY: "allowed_models"}

# An entry point as the operator lists it: ``package.module:function`` (one public attribute of
# a dotted module, no leading underscores), and an entry name as a spec gives it.
_TARGET_PART = r"[A-Za-z][A-Za-z0-9_]*"
ENTRY_TARGET_PATTERN = rf"^{_TARGET_PART}(\.{_TARGET_PART})*:{_TARGET_PART}$"
ENTRY_NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_]*$"


def check_entry_target(target: str) -> str:
    """Check an entry point's target ``package.module:function``; return it unchanged.

    Raises:
        ValueError: not a dotted module, a colon and ONE public attribute (no dots after
            the colon, no leading underscore anywhere, so no dunder).
    """
    if not re.fullmatch(ENTRY_TARGET_PATTERN, target):
        raise ValueError(
            "expected 'package.module:function' (one public function or class defined in the "
            f"module: no dots after ':', no leading underscores), got {target!r}"
        )
    return target


def check_entry_name(name: str) -> str:
    """Check an entry name (one identifier, no leading underscore); return it unchanged.

    Raises:
        ValueError: anything else, e.g. a dotted path or ``module:function``.
    """
    if not re.fullmatch(ENTRY_NAME_PATTERN, name):
        raise ValueError(
            f"expected the name of an entry point listed in allowed_models (letters, digits "
            f"and _, not a module path), got {name!r}"
        )
    return name


EntryName = Annotated[str, Field(max_length=128), AfterValidator(check_entry_name)]
EntryTarget = Annotated[str, Field(max_length=512), AfterValidator(check_entry_target)]


class ConfigError(ValueError):
    """A config file or job spec is invalid; the message names the field (INVALID_ARGUMENT)."""


class _Model(BaseModel):
    """Base of every model: unknown keys are refused, assignments are validated too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _host_port(value: str) -> str:
    """Check ``HOST:PORT`` (port 0..65535); return it unchanged."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT with a port in 0..65535, got {value!r}")
    return value


def removed_key(data: Any, key: str, why: str, allow_empty: bool = False) -> Any:
    """Refuse a key a config no longer has, saying why (a validator's ``mode="before"`` step).

    Args:
        data: the section's raw mapping (anything else passes through).
        key: the removed key.
        why: the message after ``key:``.
        allow_empty: drop the key silently when its value is empty (null, "").

    Raises:
        ValueError: ``key`` is present (pydantic names the section).
    """
    if not isinstance(data, dict) or key not in data:
        return data
    if allow_empty and not data[key]:
        return {k: v for k, v in data.items() if k != key}
    raise ValueError(f"{key}: {why}")


class LogConfig(_Model):
    """The ``log`` section of both daemons: level and format of structlog's output."""

    level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Minimum log level."
    )
    format: Literal["auto", "json", "console"] = Field(
        "auto", description="auto: JSON when stderr is not a TTY, console otherwise."
    )


class TlsConfig(_Model):
    """Mutual TLS: this daemon's certificate and the CA that signs every peer's."""

    ca_file: str = Field(
        description="PEM CA certificate; peers (servers and clients) must be signed by it."
    )
    cert_file: str = Field(
        description="PEM certificate of this daemon (server and client auth), naming it by "
        "the URI spiffe://neuroshard/coordinator or spiffe://neuroshard/worker/NAME and the "
        "hosts it is dialled at (`neuroshard certs` makes them)."
    )
    key_file: str = Field(description="PEM private key of cert_file.")

    @model_validator(mode="before")
    @classmethod
    def _no_shared_name(cls, data: Any) -> Any:
        return removed_key(
            data,
            "server_name",
            "no longer supported: every daemon has its own certificate, and each dialer "
            "checks it against the host it dials (remove server_name)",
        )


class AuthConfig(_Model):
    """Bearer-token (JWT, EdDSA/Ed25519) authentication with roles.

    The coordinator signs tokens with its private key; every daemon verifies them with the
    public key, so a worker (which holds no private key) cannot mint a token.
    """

    public_key_file: str = Field(
        description="PEM Ed25519 public key that verifies tokens; the same on every daemon "
        "(`neuroshard token keygen` makes the pair)."
    )
    private_key_file: str | None = Field(
        None,
        description="PEM Ed25519 private key that signs tokens: on the coordinator only "
        "(required there: it mints clients' data-plane tokens); never give it to a worker.",
    )
    revoked_file: str | None = Field(
        None,
        description="File of revoked token ids (jti), one per line (`neuroshard token revoke` "
        "appends); re-read within a second of a change. null: nothing revoked.",
    )
    data_token_ttl_s: float = Field(
        600.0,
        gt=0,
        le=3600,
        description="Lifetime of the data-plane tokens the coordinator mints for clients' "
        "keyed calls to workers, seconds (coordinator only).",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_daemon_token(cls, data: Any) -> Any:
        return removed_key(
            data,
            "token_file",
            "daemons present no tokens: they authenticate each other by their TLS "
            "certificates (tls.cert_file); remove token_file",
            allow_empty=True,
        )


class _DaemonConfig(_Model):
    """Settings both daemons have (their fields come first in each daemon's reference)."""

    max_concurrent_streams: int = Field(
        1024,
        ge=1,
        description="Concurrent RPCs per client connection (grpc.max_concurrent_streams); "
        "more wait for a free one.",
    )
    tls: TlsConfig | None = Field(
        None,
        description="{ca_file, cert_file, key_file}: mutual TLS, daemons known by their "
        "certificates; null: plaintext.",
    )
    auth: AuthConfig | None = Field(
        None,
        description="{public_key_file, private_key_file, revoked_file, data_token_ttl_s}: "
        "require Ed25519-signed tokens of people and daemon certificates (needs tls); "
        "null: no auth.",
    )
    log: LogConfig = Field(default_factory=LogConfig, description="level and format of logs.")
    insecure: bool = Field(
        False,
        description="Allow serving gRPC on a non-loopback address without both tls and auth "
        "(warned about at every start); without it such a daemon refuses to start.",
    )
    metrics_host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Address the Prometheus endpoint binds (loopback unless set; 0.0.0.0 "
        "exposes it to every interface, e.g. for a scraper in Kubernetes).",
    )
    probe_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Plaintext port that serves only grpc.health.v1 (liveness/readiness "
        "probes under mutual TLS); null: none.",
    )
    allowed_models: dict[EntryName, EntryTarget] = Field(
        default_factory=dict,
        description="Model entry points a job may name as `model: {entry: NAME, args: {...}}`: "
        "NAME -> 'package.module:function', a function or class defined in that module "
        "returning an nn.Module (e.g. {small_cnn: 'mymodels.vision:small_cnn'}); args are "
        "checked against its signature; empty: built-in models only.",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_allowed_imports(cls, data: Any) -> Any:
        return removed_key(
            data,
            "allowed_imports",
            "removed; list model entry points instead, as allowed_models: "
            "{NAME: 'package.module:function'}, and name them in a job as "
            "model: {entry: NAME, args: {...}}",
        )


class JobRetention(_Model):
    """How long finished jobs are kept (in memory and in the state database)."""

    max_jobs: int = Field(
        1000, ge=1, description="Finished jobs kept; the oldest beyond this are pruned."
    )
    max_age_s: float = Field(
        7 * 86400.0, gt=0, description="Finished jobs older than this are pruned, seconds."
    )


class CoordinatorConfig(_DaemonConfig):
    """The coordinator's configuration (configs/coordinator.yaml; flags override it).

    Besides the common daemon settings: where it listens and keeps its state, failure
    detection (heartbeats, probes), the store's slot count and limits, training timeouts
    and checkpoints, and the admission caps a job must fit before it is queued.
    """

    listen: str = Field(
        "127.0.0.1:50051",
        description="HOST:PORT to serve gRPC on; port 0 picks one. A non-loopback host needs "
        "tls and auth (or insecure: true).",
    )
    data_dir: str = Field(".neuroshard/coordinator", description="Directory for models and state.")
    data_roots: list[str] | None = Field(
        None,
        description="Directories job files (data.path, load, access.trace) must resolve "
        "inside; `data put` writes to the first; null: [DATA_DIR/datasets].",
    )
    metrics_port: int | None = Field(
        9100, ge=0, le=65535, description="Prometheus port; 0 picks a free one; null disables."
    )
    dashboard_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Port of the live web dashboard (read-only; HTTPS with the node "
        "certificate under tls, a token login under auth); 0 picks a free one; null disables.",
    )
    dashboard_host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Address the dashboard binds (loopback unless set; beyond loopback it "
        "needs tls and auth, or insecure: true, as the gRPC listen address does).",
    )
    dashboard_host_names: list[str] = Field(
        default_factory=list,
        description="Host names (or addresses) browsers may reach the dashboard by, besides "
        "localhost, 127.0.0.1, ::1 and dashboard_host; a request naming another Host "
        "(e.g. a DNS-rebinding page) is refused with 421.",
    )
    dashboard_max_sessions: int = Field(
        1000,
        ge=1,
        description="Most dashboard login sessions kept at once; a login beyond it ends the "
        "session closest to expiry.",
    )
    heartbeat_interval_s: float = Field(
        0.5, gt=0, le=60, description="Seconds between worker heartbeats."
    )
    heartbeat_timeout_s: float = Field(
        2.0, gt=0, le=600, description="Seconds without a heartbeat before a worker is DEAD."
    )
    probe_timeout_s: float = Field(
        0.3,
        gt=0,
        le=60,
        description="When a primary reports a worker unreachable, the "
        "coordinator probes its health; no answer within this many seconds: DEAD at once.",
    )
    readmit_holddown_max_s: float = Field(
        30.0,
        ge=0,
        le=3600,
        description="Longest hold-down, seconds, of a worker declared DEAD: it is admitted "
        "again only once the coordinator reaches its advertised address (a health check) and "
        "not sooner than a hold-down that starts at 2 x heartbeat_interval_s and doubles "
        "each time it fails that check or dies again within this many seconds of its "
        "admission, up to this cap; one that stays ALIVE this long starts again from 2 x "
        "heartbeat_interval_s. 0: no hold-down (the check still applies).",
    )
    report_rate_per_s: float = Field(
        2.0,
        gt=0,
        description="Failure reports (ReportFailure) a person or program may make per second "
        "on average (burst 10); more are RESOURCE_EXHAUSTED. Workers' own reports are not "
        "limited.",
    )
    queue_timeout_s: float = Field(
        60.0, gt=0, description="Seconds a job may wait QUEUED for its workers before it fails."
    )
    slots: int = Field(1024, ge=1, le=65536, description="Hash slots of the memory store.")
    topk_max: int = Field(10000, ge=1, description="Largest k a top-k request may ask for.")
    max_payload_bytes: int = Field(
        4096, ge=0, le=16 * 1024 * 1024, description="Largest payload of one memory, bytes."
    )
    step_timeout_s: float = Field(
        60.0, gt=0, description="Seconds a worker may take for one training step."
    )
    rpc_timeout_s: float = Field(30.0, gt=0, description="Deadline of coordinator-to-worker RPCs.")
    torch_threads: int = Field(
        1,
        ge=1,
        le=256,
        description="torch.set_num_threads for the parameter server "
        "(optimizer step, evaluation); more threads spin against the workers on a small host.",
    )
    checkpoint_every_steps: int = Field(
        50, ge=1, description="Training steps between parameter-server checkpoints."
    )
    max_message_bytes: int = Field(
        64 * 1024 * 1024, ge=1024 * 1024, description="Largest gRPC message, bytes."
    )
    chunk_bytes: int = Field(
        1024 * 1024, ge=1024, description="Tensors larger than this are streamed in chunks, bytes."
    )
    grace_s: float = Field(5.0, ge=0, description="Seconds to drain RPCs on SIGTERM.")
    max_batch_items: int = Field(
        1 << 20,
        ge=1,
        le=1 << 26,
        description="Most ids clients put in one keyed memory request (upsert, get, delete, "
        "reinforce): published in the slot map, clients split larger batches; keep it equal "
        "to the workers' max_batch_items.",
    )
    max_concurrent_exports: int = Field(
        2,
        ge=1,
        description="ExportMemories streams served at once (all clients together); one more "
        "is RESOURCE_EXHAUSTED. Each holds up to export_batch_bytes, count.",
    )
    export_batch_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1024 * 1024,
        description="Most bytes (ids, strengths and payloads) an export reads from the "
        "primaries and holds at once; a batch that would exceed it is read again in fewer "
        "slots (one slot is read whole whatever its size), bytes.",
    )
    export_batch_memories: int = Field(
        500_000,
        ge=1,
        description="About how many memories an export reads per batch (slots per batch = "
        "slots x this / memories stored, at least 1; export_batch_bytes caps it too), count.",
    )
    copy_chunk_memories: int = Field(
        131_072,
        ge=1,
        description="About how many memories one CopySlots request of a slot copy "
        "(re-replication, join, leave) carries, by the source's average per slot; a request "
        "holds at least one slot. The source holds its writes to the slots it copies while "
        "it sends them, and each request costs the target a pass over its store, count.",
    )
    copy_pause_factor: float = Field(
        1.5,
        ge=0,
        le=100,
        description="After each CopySlots request, wait this many times as long as it took "
        "before the next one of the same source and target, so the writes the copy held "
        "back get through (as Ceph's osd_recovery_sleep): writes run at least "
        "factor / (1 + factor) of the time; 0: no pause, ratio.",
    )
    max_jobs_per_client: int = Field(
        100,
        ge=1,
        description="Queued plus running jobs one token subject may have (all clients "
        "together without auth); more is RESOURCE_EXHAUSTED.",
    )

    max_spec_bytes: int = Field(
        64 * 1024, ge=1024, description="Largest job spec (its JSON), bytes."
    )
    max_memories_per_job: int = Field(
        20_000_000,
        ge=1,
        description="Most memories one memory job may generate or load.",
    )
    max_model_params: int = Field(
        50_000_000,
        ge=1,
        description="Most parameters of a job's model (estimated before it is built; the "
        "parameter server holds them and Adam's two moments, 12 bytes each).",
    )
    max_dataset_bytes: int = Field(
        1 << 30,
        ge=1024,
        description="Largest data set a job may use or `data put` may store (file size, or "
        "x of a synthetic set as float32), bytes.",
    )
    max_steps: int = Field(
        1_000_000,
        ge=1,
        description="Most training steps (or memory-job iterations) one job may run.",
    )
    max_synthetic_bytes: int = Field(
        1 << 30,
        ge=1024,
        description="Most memory a synthetic data set takes while each daemon generates it "
        "(float64 class centres, 8 x classes x features, plus float64 samples and their "
        "float32 copy, 12 x samples x features), bytes.",
    )
    max_activation_bytes: int = Field(
        1 << 30,
        ge=1024,
        description="Most activation memory of one micro-batch of batch_size rows (the "
        "outputs of every layer in a forward pass run on torch's meta device, which "
        "allocates nothing), bytes.",
    )
    max_access_batch_bytes: int = Field(
        256 << 20,
        ge=1024,
        description="Most memory the coordinator spends on one memory-job access batch "
        "(access.batch, or a trace's row length, x 96 bytes per access: drawing the Zipf "
        "ranks, ids and boosts, routing), bytes.",
    )
    max_concurrent_uploads: int = Field(
        4,
        ge=1,
        description="Most `data put` uploads in progress at once (all clients together); "
        "one more is RESOURCE_EXHAUSTED until one ends.",
    )
    max_data_root_bytes: int = Field(
        16 << 30,
        ge=1024,
        description="Most bytes the first data root (where `data put` writes) may hold, "
        "uploads in progress counted at their declared size; an upload that would pass it "
        "is RESOURCE_EXHAUSTED, bytes.",
    )
    job_retention: JobRetention = Field(
        default_factory=JobRetention,
        description="{max_jobs, max_age_s}: finished jobs kept; older ones are pruned.",
    )

    _check_listen = field_validator("listen")(classmethod(lambda cls, v: _host_port(v)))

    def dataset_roots(self) -> list[Path]:
        """The data roots as absolute paths (``data_roots``, or ``DATA_DIR/datasets``)."""
        roots = self.data_roots if self.data_roots else [str(Path(self.data_dir) / "datasets")]
        return [Path(r).expanduser().absolute() for r in roots]

    @field_validator("slots")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"must be a power of two, got {v}")
        return v

    @model_validator(mode="after")
    def _timeout_after_interval(self) -> CoordinatorConfig:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(
                "heartbeat_timeout_s must be larger than heartbeat_interval_s "
                f"({self.heartbeat_timeout_s} <= {self.heartbeat_interval_s})"
            )
        return self


class WorkerConfig(_DaemonConfig):
    """A worker's configuration (configs/worker.yaml; flags override it).

    Besides the common daemon settings: the coordinator to join, its name and address, its
    slot data dir and how often its log is fsynced and snapshotted, the memory kernels'
    device, and its request limits.
    """

    coordinator: str = Field("localhost:50051", description="Coordinator HOST:PORT.")
    listen: str = Field(
        "127.0.0.1:0",
        description="HOST:PORT to serve gRPC on; port 0 picks one. A non-loopback host needs "
        "tls and auth (or insecure: true).",
    )
    advertise_host: str | None = Field(
        None,
        description="Host other daemons use to reach this worker (default: listen host, "
        "or 127.0.0.1 when listening on all interfaces).",
    )
    advertise_address: str | None = Field(
        None,
        description="HOST:PORT registered with the coordinator instead of advertise_host and "
        "the bound port, verbatim: the address the coordinator and peers dial, e.g. a "
        "`neuroshard link` proxy in front of this worker. Exclusive with advertise_host.",
    )
    name: str | None = Field(
        None, min_length=1, max_length=128, description="Worker name; default: the hostname."
    )
    data_dir: str = Field(
        ".neuroshard/worker",
        description="Directory of this worker's slot data (snapshot and log); one per worker.",
    )
    fsync: Literal["always", "interval", "never"] = Field(
        "always",
        description="When the slot log is fsynced: always (before a write is acknowledged), "
        "interval (every fsync_interval_s) or never (left to the OS; a killed process still "
        "loses nothing, a power cut may).",
    )
    fsync_interval_s: float = Field(
        1.0, gt=0, le=60, description="fsync period of the slot log with fsync: interval, seconds."
    )
    snapshot_log_bytes: int = Field(
        64 * 1024 * 1024,
        ge=4096,
        description="Snapshot the slots once the log since the last snapshot exceeds this, bytes.",
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Prometheus port; 0 picks a free one; null disables."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Memory kernels on CuPy (cuda) or NumPy (cpu); auto: cuda if found."
    )
    torch_threads: int = Field(1, ge=1, le=256, description="torch.set_num_threads for training.")
    max_payload_bytes: int = Field(
        4096,
        ge=0,
        description="Payload limit, bytes, until the coordinator's cluster-wide "
        "max_payload_bytes arrives with the slot map (which then applies).",
    )
    max_message_bytes: int = Field(
        64 * 1024 * 1024, ge=1024 * 1024, description="Largest gRPC message, bytes."
    )
    chunk_bytes: int = Field(1024 * 1024, ge=1024, description="Stream chunk size, bytes.")
    rpc_timeout_s: float = Field(30.0, gt=0, description="Deadline of worker-issued RPCs.")
    drain_timeout_s: float = Field(
        60.0, ge=0, description="On SIGTERM, seconds to wait for the slots to be handed over."
    )
    grace_s: float = Field(5.0, ge=0, description="Seconds to drain RPCs on SIGTERM.")
    max_batch_items: int = Field(
        1 << 20,
        ge=1,
        le=1 << 26,
        description="Most ids one keyed memory request (upsert, get, delete, reinforce) may "
        "carry; more is INVALID_ARGUMENT.",
    )
    max_receive_slots_bytes: int = Field(
        2 << 30,
        ge=1024 * 1024,
        description="Most bytes one incoming slot copy (a peer's ReceiveSlots stream of up to "
        "64 slots) may bring; the stream is counted as it arrives and more is "
        "RESOURCE_EXHAUSTED, nothing installed. Keep it above the largest 64 slots' memories "
        "x (12 + payload) bytes, bytes.",
    )

    _check_addr = field_validator("coordinator", "listen")(
        classmethod(lambda cls, v: _host_port(v))
    )

    @field_validator("advertise_address")
    @classmethod
    def _dialable(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            return v
        if info.data.get("advertise_host") is not None:  # declared, so validated, before
            raise ValueError(
                "advertise_host and advertise_address are exclusive: advertise_address is the "
                f"whole HOST:PORT (got advertise_host={info.data['advertise_host']!r})"
            )
        if int(_host_port(v).rpartition(":")[2]) == 0:
            raise ValueError(f"port 0 cannot be dialed; give the port others connect to ({v!r})")
        return v


# ---------------------------------------------------------------------------------------------
# Job specs


class MlpSpec(_Model):
    """The built-in multilayer perceptron: Flatten, then Linear + ReLU per hidden width."""

    name: Literal["mlp"] = "mlp"
    hidden: list[Annotated[int, Field(ge=1, le=65536)]] = Field(
        default_factory=lambda: [128, 64], description="Hidden layer widths."
    )


class CnnSpec(_Model):
    """The built-in CNN: two 3x3 conv layers with ReLU and max-pools, for 8x8 or 28x28 images."""

    name: Literal["cnn"] = "cnn"
    channels: list[Annotated[int, Field(ge=1, le=1024)]] = Field(
        default_factory=lambda: [16, 32], description="Channels of the two conv layers."
    )


class EntryModelSpec(_Model):
    """A model built by an entry point the operator listed in ``allowed_models``.

    Written ``{entry: NAME, args: {...}}``; the coordinator and every worker look NAME up in
    their own ``allowed_models`` and check ``args`` against the factory's signature
    (``shared.training.entry_points``).
    """

    entry: EntryName = Field(
        description="Name of a model entry point in allowed_models of the coordinator and "
        "of the workers.",
        json_schema_extra=MODEL_ENTRY_REF,
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of the entry point's factory."
    )


class BuiltinData(_Model):
    """A built-in data set: ``digits`` (scikit-learn's bundled 8x8 digits) or ``synthetic``."""

    name: Literal["digits", "synthetic"] = "digits"
    samples: int = Field(2000, ge=10, description="synthetic only: number of samples.")
    features: int = Field(64, ge=1, description="synthetic only: features per sample.")
    classes: int = Field(10, ge=2, description="synthetic only: number of classes.")

    @model_validator(mode="after")
    def _classes_fit(self) -> BuiltinData:
        if self.name == "synthetic" and self.classes > self.samples:
            raise ValueError(
                f"classes: {self.classes} is more than samples ({self.samples}); every class "
                "needs a sample"
            )
        return self


class FileData(_Model):
    """A training set in an ``.npz`` file inside the coordinator's data roots."""

    path: str = Field(
        max_length=4096,
        description=".npz file with arrays x (float32) and y (int64), inside the "
        "coordinator's data_roots (relative: looked up in each root).",
        json_schema_extra=DATA_PATH_REF,
    )


class OptimizerSpec(_Model):
    """The optimizer: SGD (with momentum), Adam or AdamW (``torch.optim``)."""

    name: Literal["sgd", "adam", "adamw"] = "adam"
    lr: float = Field(1e-3, gt=0, le=10, description="Peak learning rate.")
    momentum: float = Field(0.9, ge=0, lt=1, description="sgd only.")
    weight_decay: float = Field(
        0.0, ge=0, le=1, description="L2 penalty (sgd, adam) or decoupled decay (adamw)."
    )


class LrScheduleSpec(_Model):
    """The learning rate over the optimizer steps, after an optional linear warm-up.

    ``constant``: lr. ``cosine``: from lr down to ``lr * min_lr_factor`` over the remaining
    steps (Loshchilov & Hutter 2017, without restarts). ``linear``: from lr down to
    ``lr * min_lr_factor``. ``step``: lr times ``gamma`` every ``step_size`` steps. Warm-up
    rises linearly from ``lr / warmup_steps`` to lr (Goyal et al. 2017). Built from
    ``torch.optim.lr_scheduler`` and stepped once per optimizer step.
    """

    name: Literal["constant", "cosine", "linear", "step"] = "constant"
    warmup_steps: int = Field(0, ge=0, le=10_000_000, description="Linear warm-up, steps.")
    min_lr_factor: float = Field(
        0.0, ge=0, le=1, description="cosine, linear: the final lr as a fraction of lr."
    )
    step_size: int = Field(100, ge=1, description="step: optimizer steps between decays.")
    gamma: float = Field(0.1, gt=0, le=1, description="step: factor applied every step_size.")


class StragglerSpec(_Model):
    """What a ``sync`` step does about workers slower than the others.

    The step deadline adapts: ``max(deadline_factor x median, median + 3 x 1.4826 x MAD)`` of
    the recent step times of the job's healthy workers, at most the coordinator's
    ``step_timeout_s`` (``coordinator.network.straggler.step_deadline_s``).
    """

    mode: Literal["wait", "backup", "drop"] = Field(
        "wait",
        description="wait: every piece of the step is waited for (up to step_timeout_s); "
        "backup: pieces still missing at the deadline are recomputed by workers that "
        "finished, the first answer wins (the step stays the full global batch); drop: at "
        "the deadline the step goes on with the pieces that arrived, reweighted by samples.",
    )
    deadline_factor: float = Field(
        2.0, gt=1, le=100, description="The deadline as a multiple of the median step time."
    )
    min_fraction: float = Field(
        0.5,
        gt=0,
        le=1,
        description="drop: the step goes on at the deadline only with at least this share "
        "of its samples (else it waits for more, up to step_timeout_s).",
    )


class CompressionSpec(_Model):
    """Compression of the tensors a training step sends.

    ``sync`` and ``diloco``: gradients (pseudo-gradients) up and parameter deltas down are
    compressed with error feedback (``shared.training.compression``): ``fp16``, ``int8``
    (per-tensor scale), ``topk`` (the ``ratio`` largest magnitudes). ``allreduce``: torch's
    DDP communication hooks: ``fp16``, ``bf16`` (NCCL only), ``powersgd`` (rank ``rank``).
    """

    name: Literal["none", "fp16", "bf16", "int8", "topk", "powersgd"] = "none"
    ratio: float = Field(
        0.01, gt=0, le=1, description="topk: the fraction of each tensor's elements sent."
    )
    rank: int = Field(2, ge=1, le=64, description="powersgd: the low-rank approximation's rank.")


_COMPRESSION_BY_STRATEGY = {
    "sync": ("none", "fp16", "int8", "topk"),
    "diloco": ("none", "fp16", "int8", "topk"),
    "allreduce": ("none", "fp16", "bf16", "powersgd"),
}


def _tag_by_name(default: str, alt_key: str) -> Discriminator:
    """A discriminator: a dict is tagged by its ``name`` key, or ``alt_key`` when present."""

    def tag(v: Any) -> str:
        if isinstance(v, dict):
            return alt_key if alt_key in v else str(v.get("name", default))
        return alt_key if getattr(v, "name", None) is None else str(v.name)

    return Discriminator(
        tag,
        custom_error_type="invalid_choice",
        custom_error_message=f"unknown name; expected one of the built-ins or {alt_key!r}",
    )


def _name_to_dict(v: Any) -> Any:
    """Accept the short form ``model: mlp`` for ``model: {name: mlp}``."""
    return {"name": v} if isinstance(v, str) else v


ModelField = Annotated[
    Annotated[MlpSpec, Tag("mlp")]
    | Annotated[CnnSpec, Tag("cnn")]
    | Annotated[EntryModelSpec, Tag("entry")],
    _tag_by_name("mlp", "entry"),
]
DataField = Annotated[
    Annotated[BuiltinData, Tag("digits")]
    | Annotated[BuiltinData, Tag("synthetic")]
    | Annotated[FileData, Tag("path")],
    _tag_by_name("digits", "path"),
]


class TrainJobSpec(_Model):
    """A ``train`` job: a model trained on a data set by synchronous data parallelism.

    Each step every worker computes gradients on ``batch_size`` rows of its shard, and the
    parameter server averages them (weighted by rows) and steps the optimizer.
    """

    kind: Literal["train"] = Field(description="'train'.")
    name: str = Field("train", max_length=128, description="A label for people.")
    workers: int = Field(1, ge=1, le=1024, description="Workers the job needs.")
    model: ModelField = Field(
        default_factory=MlpSpec,
        description="'mlp', 'cnn', {name: mlp, hidden: [...]}, "
        "{name: cnn, channels: [...]} or {entry: NAME, args: {...}} (NAME listed in "
        "allowed_models).",
    )
    data: DataField = Field(
        default_factory=BuiltinData,
        description="'digits', 'synthetic', {name: ...} or {path: F.npz}.",
    )
    optimizer: OptimizerSpec = Field(
        default_factory=OptimizerSpec,
        description="{name: sgd|adam|adamw, lr, momentum (sgd), weight_decay}.",
    )
    lr_schedule: LrScheduleSpec = Field(
        default_factory=LrScheduleSpec,
        description="{name: constant|cosine|linear|step, warmup_steps, min_lr_factor, "
        "step_size, gamma}.",
    )
    strategy: Literal["sync", "allreduce", "diloco"] = Field(
        "sync",
        description="sync: parameter server on the coordinator, gradients averaged every "
        "step. allreduce: the workers form a torch.distributed group and train with DDP. "
        "diloco: inner_steps local steps per worker, pseudo-gradients averaged, outer "
        "Nesterov step on the coordinator (Douillard et al. 2023).",
    )
    straggler: StragglerSpec = Field(
        default_factory=StragglerSpec,
        description="sync, diloco: {mode: wait|backup|drop, deadline_factor, min_fraction}.",
    )
    batch_policy: Literal["fixed", "proportional"] = Field(
        "fixed",
        description="sync, diloco: fixed: every worker computes batch_size rows a step; "
        "proportional: the global batch (workers x batch_size) is split by each worker's "
        "measured samples/s (transfer included).",
    )
    compression: CompressionSpec = Field(
        default_factory=CompressionSpec,
        description="{name: none|fp16|int8|topk (sync, diloco) or none|fp16|bf16|powersgd "
        "(allreduce), ratio, rank}.",
    )
    aggregation: Literal["mean", "trimmed_mean", "median"] = Field(
        "mean",
        description="sync, diloco: how the workers' gradients are combined: the "
        "sample-weighted mean, a coordinate-wise trimmed mean, or the coordinate-wise median.",
    )
    trim: float = Field(
        0.1,
        ge=0,
        lt=0.5,
        description="trimmed_mean: the share of values dropped at each end of every coordinate.",
    )
    max_grad_norm_ratio: float | None = Field(
        None,
        gt=1,
        description="sync, diloco: reject a worker's gradient whose L2 norm is more than this "
        "times the median of the step's norms, or less than the median over this; null: off.",
    )
    health_threshold: float = Field(
        0.25,
        ge=0,
        lt=1,
        description="sync, diloco: a worker whose health score falls below this is excluded "
        "for probation_steps steps (0: never excluded); see the README for the formula.",
    )
    probation_steps: int = Field(
        20, ge=1, le=1_000_000, description="Steps an excluded worker sits out before a trial."
    )
    inner_steps: int = Field(
        10,
        ge=1,
        le=100_000,
        description="diloco: H, local (inner) optimizer steps per worker per outer step; the "
        "last outer step of an epoch may cover fewer.",
    )
    outer_lr: float = Field(0.7, gt=0, le=10, description="diloco: the outer Nesterov SGD lr.")
    outer_momentum: float = Field(
        0.9, ge=0, lt=1, description="diloco: the outer Nesterov SGD momentum."
    )
    min_workers: int | None = Field(
        None,
        ge=1,
        le=1024,
        description="allreduce: fewest workers a generation may run with (default: workers).",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="allreduce: torch.distributed backend; auto: nccl when the job trains "
        "on cuda, else gloo.",
    )
    collective_timeout_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="allreduce: a collective (or the rendezvous) waiting longer than this, "
        "seconds, ends the generation.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the model trains; auto: cuda when every worker has it."
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        description="Forward/backward under torch.autocast in this dtype (fp16 with a "
        "GradScaler); parameters and optimizer state stay float32.",
    )
    grad_accum_steps: int = Field(
        1,
        ge=1,
        le=1024,
        description="Mini-batches of batch_size per worker per optimizer step; the global "
        "batch is workers x batch_size x grad_accum_steps.",
    )
    clip_grad_norm: float | None = Field(
        None,
        gt=0,
        description="Clip the global gradient's L2 norm to this before each optimizer step; "
        "null: no clipping.",
    )
    sync_batchnorm: bool = Field(
        False,
        description="allreduce: BatchNorm statistics over the global batch "
        "(torch.nn.SyncBatchNorm on cuda, an all-reduce of sums on cpu).",
    )
    epochs: int | None = Field(
        None, ge=1, le=100000, description="Passes over the training split (default 10)."
    )
    steps: int | None = Field(
        None,
        ge=1,
        le=10_000_000,
        description="Optimizer steps (diloco: inner steps per worker); overrides epochs.",
    )
    batch_size: int = Field(32, ge=1, le=65536, description="Samples per worker per step.")
    seed: int = Field(0, ge=0, description="Seeds model init, split and data order.")
    test_fraction: float = Field(0.2, gt=0, lt=1, description="Held-out share of the data.")

    _strings = field_validator("model", "data", mode="before")(
        classmethod(lambda cls, v: _name_to_dict(v))
    )

    @field_validator("model", mode="before")
    @classmethod
    def _no_import(cls, v: Any) -> Any:
        if isinstance(v, dict) and "import" in v:
            raise ValueError(
                "'import' is no longer accepted; name an entry point the operator listed in "
                "allowed_models: {entry: NAME, args: {...}}"
            )
        return v

    @model_validator(mode="after")
    def _epochs_or_steps(self) -> TrainJobSpec:
        if self.epochs is None and self.steps is None:
            self.epochs = 10
        if self.min_workers is None:
            self.min_workers = self.workers
        elif self.min_workers > self.workers:
            raise ValueError(
                f"min_workers: {self.min_workers} is more than workers ({self.workers})"
            )
        if self.sync_batchnorm and self.strategy != "allreduce":
            raise ValueError(
                "sync_batchnorm: needs strategy allreduce (with sync, the coordinator "
                "averages the workers' BatchNorm statistics instead)"
            )
        if self.backend == "nccl" and self.device == "cpu":
            raise ValueError("backend: nccl needs device cuda (or auto), not cpu")
        allowed = _COMPRESSION_BY_STRATEGY[self.strategy]
        if self.compression.name not in allowed:
            raise ValueError(
                f"compression.name: {self.compression.name!r} is not available with strategy "
                f"{self.strategy} (expected one of {', '.join(allowed)})"
            )
        self._diloco_controls()
        return self

    def _diloco_controls(self) -> None:
        """Refuse what ``strategy: diloco`` does not do, naming the field.

        fp16 needs a loss scale kept across a worker's local steps (a GradScaler per worker),
        which the outer step cannot use; bf16 and fp32 need none.
        """
        if self.strategy == "diloco" and self.precision == "fp16":
            raise ValueError(
                "precision: fp16 is not available with strategy diloco (use bf16 or fp32)"
            )


# Bytes the coordinator holds per access of one memory-job batch, at most: the Zipf draw's
# float64 and int64 temporaries, the ids and boosts, and the router's positions and owners
# (measured about 75 at 10**7 accesses). Admission caps access.batch x ACCESS_BYTES
# (max_access_batch_bytes).
ACCESS_BYTES = 96


class ZipfAccess(_Model):
    """A memory job's accesses: Zipf-popular ids of the store, as YCSB's scrambled Zipfian.

    Ranks come from Gray et al.'s generator ("Quickly generating billion-record synthetic
    databases", SIGMOD 1994) and are scattered over the stored ids by a seeded permutation,
    so hot ids do not cluster.
    """

    distribution: Literal["zipf"] = "zipf"
    alpha: float = Field(
        0.99,
        gt=0,
        lt=1,
        description="Zipf constant theta in (0, 1) (YCSB's default 0.99; Gray et al.'s "
        "generator needs theta < 1).",
    )
    batch: int = Field(100_000, ge=1, le=100_000_000, description="Accesses per iteration.")
    boost: float = Field(0.05, ge=0, le=1, description="Boost added per access.")


class TraceAccess(_Model):
    """A memory job's accesses replayed from an ``.npy`` of ids in the data roots."""

    trace: str = Field(
        max_length=4096,
        description=".npy of ids: [iterations, batch] or [batch] uint64, inside the "
        "coordinator's data_roots.",
        json_schema_extra=DATA_PATH_REF,
    )
    boost: float = Field(0.05, ge=0, le=1)


def _access_tag(v: Any) -> str:
    """A mapping with a ``trace`` key is a trace; anything else is the Zipf stream."""
    return (
        "trace" if (isinstance(v, dict) and "trace" in v) or isinstance(v, TraceAccess) else "zipf"
    )


AccessField = Annotated[
    Annotated[ZipfAccess, Tag("zipf")] | Annotated[TraceAccess, Tag("trace")],
    Discriminator(_access_tag),
]


class MemoryJobSpec(_Model):
    """A ``memory`` job: iterations of reinforce, decay, quality and top-k over the store.

    The store is filled first with ``memories`` generated memories, or those of ``load``;
    each iteration then reinforces the ids of one batch of accesses, decays every memory,
    and asks for quality statistics and the top-k, timing each iteration.
    """

    kind: Literal["memory"] = Field(description="'memory'.")
    name: str = Field("memory", max_length=128, description="A label for people.")
    workers: int = Field(1, ge=1, le=1024, description="Alive workers the job waits for.")
    memories: int = Field(1_000_000, ge=1, le=1_000_000_000, description="Memories to generate.")
    load: str | None = Field(
        None,
        max_length=4096,
        description=".npz with arrays ids, strengths to load instead, inside the "
        "coordinator's data_roots.",
        json_schema_extra=DATA_PATH_REF,
    )
    iterations: int = Field(
        100, ge=1, le=10_000_000, description="Rounds of reinforce, decay, quality, top-k."
    )
    access: AccessField = Field(
        default_factory=ZipfAccess,
        description="{distribution: zipf, alpha, batch, boost} or {trace: F.npy, boost}.",
    )
    decay_rate: float = Field(0.001, ge=0, le=1, description="Strength subtracted per iteration.")
    topk: int = Field(100, ge=1, description="k of the top-k query each iteration.")
    seed: int = Field(0, ge=0, description="Seeds the generated memories and access stream.")


JobSpec = TrainJobSpec | MemoryJobSpec


_UNION_FIELDS = {"model", "data", "access"}
_UNION_TAGS = {"mlp", "cnn", "entry", "digits", "synthetic", "path", "zipf", "trace"}


def format_validation_error(exc: ValidationError, prefix: str = "") -> str:
    """The first error as ``dotted.key: message``, counting the others."""
    err = exc.errors()[0]
    parts: list[str] = []
    tag_dropped = False
    for p in err["loc"]:
        # Drop the one union tag pydantic inserts after a tagged-union field (model.mlp.hidden);
        # a field named like a tag after it stays (model.entry).
        if parts and parts[-1] in _UNION_FIELDS and p in _UNION_TAGS and not tag_dropped:
            tag_dropped = True
            continue
        if not str(p).startswith(("function-after", "tagged")):
            parts.append(str(p))
            tag_dropped = False
    loc = ".".join(parts)
    msg = err["msg"].removeprefix("Value error, ")
    # A model-level check has no field: "FILE: message" (its message names the fields).
    where = f"{prefix}{loc}" if loc else (prefix.removesuffix(": ").rstrip(".") or "spec")
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{where}: {msg}{more}"


def parse_job_spec(data: object) -> JobSpec:
    """Validate a job spec given as a dict (from YAML or JSON); its ``kind`` picks the model.

    Raises:
        ConfigError: unknown key, wrong type, out-of-range value; the message names the field
            (the coordinator maps it to INVALID_ARGUMENT).
    """
    if not isinstance(data, dict):
        raise ConfigError(f"job spec: expected a mapping, got {type(data).__name__}")
    kind = data.get("kind")
    model: type[TrainJobSpec] | type[MemoryJobSpec]
    if kind == "train":
        model = TrainJobSpec
    elif kind == "memory":
        model = MemoryJobSpec
    else:
        raise ConfigError(f"kind: expected 'train' or 'memory', got {kind!r}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def job_spec_from_json(text: str) -> JobSpec:
    """Parse and validate a job spec sent as JSON (the SubmitJob RPC).

    Raises:
        ConfigError: invalid JSON or an invalid spec (INVALID_ARGUMENT).
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"spec_json: not valid JSON ({exc.msg} at char {exc.pos})") from None
    except RecursionError:
        raise ConfigError("spec_json: nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more digits than int() converts
        raise ConfigError(f"spec_json: {str(exc)[:200]}") from None
    return parse_job_spec(data)


def load_yaml(path: str | Path) -> Any:
    """Read a YAML file with ``yaml.safe_load`` (no Python objects are constructed).

    Returns:
        What the file holds; ``{}`` for an empty file.

    Raises:
        ConfigError: the file is missing or is not valid YAML.
    """
    p = Path(path)
    try:
        return yaml.safe_load(p.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: invalid YAML: {exc}") from None


def load_config(model: type[T], path: str | Path | None, **overrides: Any) -> T:
    """Load a daemon config from YAML (or defaults), apply non-None overrides, validate.

    Args:
        model: the config class, ``CoordinatorConfig`` or ``WorkerConfig``.
        path: a YAML file of settings; None: defaults only.
        **overrides: settings that win over the file (the CLI's flags); None values are
            ignored.

    Raises:
        ConfigError: the message names the file and field; also a file that is missing, not
            YAML, or not a mapping of settings.
    """
    loaded = load_yaml(path) if path else {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(loaded).__name__}")
    data = dict(loaded)
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, f"{path}: " if path else "")) from None
