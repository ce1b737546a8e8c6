"""The daemons' configurations: CoordinatorConfig, WorkerConfig and their sections.

The sections are log, tls, auth (both daemons) and job_retention (the coordinator). Both are
read from YAML by ``shared.config.loading.load_config``, the CLI's flags overriding the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from shared.config.fields import (
    ConfigModel,
    EntryName,
    EntryTarget,
    check_host_port,
    removed_key,
)


class LogConfig(ConfigModel):
    """The ``log`` section of both daemons: level and format of structlog's output."""

    level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Minimum log level."
    )
    format: Literal["auto", "json", "console"] = Field(
        "auto", description="auto: JSON when stderr is not a TTY, console otherwise."
    )


class TlsConfig(ConfigModel):
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


class AuthConfig(ConfigModel):
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


class _DaemonConfig(ConfigModel):
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
    allowed_losses: dict[EntryName, EntryTarget] = Field(
        default_factory=dict,
        description="Loss entry points a train job may name as `loss: {entry: NAME, args: "
        "{...}}`: NAME -> 'package.module:function', a function or class defined in that "
        "module whose call with args returns loss(outputs, targets) -> per-sample losses [B] "
        "(e.g. {pinball: 'mylosses.quantile:pinball'}); empty: built-in losses only.",
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


class JobRetention(ConfigModel):
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
    max_sample_batch: int = Field(
        65536, ge=1, description="Largest n (draws) one Sample request may ask for."
    )
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
        description="Most memories one memory job may generate or load, and most training "
        "rows of a prioritized train job (one memory each in its priority table).",
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
    max_compressed_array_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="Largest array of a compressed .npz (np.savez_compressed) a train job may "
        "use, once inflated, bytes: a compressed array cannot be memory-mapped, so it is "
        "inflated into memory; a larger one is refused (save it uncompressed or as a "
        "directory of .npy files).",
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

    _check_listen = field_validator("listen")(classmethod(lambda cls, v: check_host_port(v)))

    def dataset_roots(self) -> list[Path]:
        """The data roots as absolute paths (``data_roots``, or ``DATA_DIR/datasets``)."""
        roots = self.data_roots if self.data_roots else [str(Path(self.data_dir) / "datasets")]
        return [Path(r).expanduser().absolute() for r in roots]

    def tensorboard_dir(self) -> Path:
        """Where train jobs write TensorBoard event files: ``DATA_DIR/tensorboard``."""
        return Path(self.data_dir).expanduser().absolute() / "tensorboard"

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
    shard_cache_bytes: int = Field(
        8 << 30,
        ge=0,
        description="Most bytes of fetched training rows kept in DATA_DIR/shard_cache across "
        "jobs (by data set content and row range), bytes; the least recently used entries "
        "not in use by a running job are removed past it. 0 keeps nothing once a job ends.",
    )
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
        classmethod(lambda cls, v: check_host_port(v))
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
        if int(check_host_port(v).rpartition(":")[2]) == 0:
            raise ValueError(f"port 0 cannot be dialed; give the port others connect to ({v!r})")
        return v
