"""Deploy-check of each daemon as a rendered overlay would run it: secure, and consistent.

A ``Daemon`` is one StatefulSet's container with the config it would load: its args parsed
by the real ``neuroshard`` parser, its ``--config`` file taken from the ConfigMap, the
flags applied over it, validated as ``CoordinatorConfig`` or ``WorkerConfig``. On that:

* security: ``tls`` and ``auth`` set, ``insecure`` not true, the coordinator holding the
  token-signing private key and workers never; no ``tls.server_name`` (each dialer checks
  the host it dials against the peer's certificate) and no token between daemons (they
  authenticate each other by their certificates): no ``auth.token_file``, no Secret key
  named like a token mounted; a worker's name is its pod's name (downward API
  ``metadata.name``), the name its certificate holds (``check_certs``);
* secrets: every file the config names lies in a read-only mount of a Secret volume that
  lists its items (not optional, files 0400 or 0440, fsGroup set so the non-root user reads
  them) or, for the TLS files, of a cert-manager csi-driver volume (one certificate per pod,
  files made readable by the pod's fsGroup), and the Secret holding the private key is
  mounted in the coordinator's pod only;
* ports: ``listen``, ``probe_port`` and ``metrics_port`` are the container ports ``grpc``,
  ``probe`` and ``metrics``, every probe is a gRPC probe of ``probe_port``, Prometheus'
  annotation names ``metrics_port`` off loopback, the Services reach the gRPC ports, and a
  worker's ``coordinator`` and ``advertise_host`` name Services that lead to them.

Every function returns one line per problem, prefixed with the object it is about.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import io
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from shared.cli.main import build_parser
from shared.cli.security import daemon_overrides
from shared.config import ConfigError, CoordinatorConfig, WorkerConfig, load_config
from shared.security.exposure import is_loopback

MODELS: dict[str, type[CoordinatorConfig] | type[WorkerConfig]] = {
    "coordinator": CoordinatorConfig,
    "worker": WorkerConfig,
}
SECRET_MODES = (0o400, 0o440)  # owner, or owner and fsGroup; never world-readable
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
OTHER_WORKLOADS = ("Pod", "Deployment", "ReplicaSet", "DaemonSet", "Job", "CronJob")
# What a $(VAR) from the downward API's metadata.name stands for when the args are parsed
# (and ${POD_NAME} in a csi volume's attributes, check_certs): a worker registers under it.
POD_NAME_SAMPLE = "sample-pod-name"
CSI_DRIVER = "csi.cert-manager.io"  # cert-manager's csi-driver: a certificate per pod
# The files a csi-driver volume holds: attribute -> default name.
CSI_FILES = {
    f"{CSI_DRIVER}/certificate-file": "tls.crt",
    f"{CSI_DRIVER}/privatekey-file": "tls.key",
    f"{CSI_DRIVER}/ca-file": "ca.crt",
}
TOKEN_KEYS = ("*token*", "*jwt*")  # Secret keys that hold a bearer token (case-insensitive)


@dataclass
class Daemon:
    """One StatefulSet's daemon: its objects and the config it would run with."""

    name: str  # the StatefulSet's name
    command: str  # coordinator | worker
    sts: dict[str, Any]
    config: CoordinatorConfig | WorkerConfig

    @property
    def pod(self) -> dict[str, Any]:
        return self.sts["spec"]["template"]["spec"]  # type: ignore[no-any-return]

    @property
    def container(self) -> dict[str, Any]:
        return self.pod["containers"][0]  # type: ignore[no-any-return]

    @property
    def labels(self) -> dict[str, str]:
        return self.sts["spec"]["template"]["metadata"].get("labels", {})  # type: ignore[no-any-return]

    @property
    def namespace(self) -> str:
        return self.sts["metadata"].get("namespace", "default")  # type: ignore[no-any-return]

    def port(self, name: str) -> int | None:
        """The container port called ``name``, or None."""
        for p in self.container.get("ports", []):
            if p.get("name") == name:
                return int(p["containerPort"])
        return None


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    """The objects of one kind, by name."""
    return {d["metadata"]["name"]: d for d in docs if d.get("kind") == kind}


def _env_value(var: dict[str, Any], namespace: str) -> str:
    """What an env variable holds in the pod: its literal value, the pod's name as
    ``POD_NAME_SAMPLE`` or its namespace (downward API), else ``env-VAR`` (a sample)."""
    if "value" in var:
        return str(var["value"])
    field = var.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
    if field == "metadata.name":
        return POD_NAME_SAMPLE
    if field == "metadata.namespace":
        return namespace
    # named after the variable, never POD_NAME_SAMPLE (POD_NAME from another field is not it)
    return "env-" + str(var["name"]).lower().replace("_", "-")


def _expand_env(container: dict[str, Any], namespace: str) -> tuple[list[str], list[str]]:
    """The container's args with each ``$(VAR)`` replaced by what the variable holds
    (``_env_value``), and the names of referenced variables its env does not define
    (Kubernetes would leave those verbatim)."""
    values = {e["name"]: _env_value(e, namespace) for e in container.get("env", [])}
    refs = {v for a in container.get("args", []) for v in re.findall(r"\$\((\w+)\)", a)}
    args = [
        re.sub(r"\$\((\w+)\)", lambda m: values.get(m.group(1), m.group(0)), a)
        for a in container.get("args", [])
    ]
    return args, sorted(refs - set(values))


def _parse_args(args: list[str]) -> argparse.Namespace | str:
    """Parse with the real ``neuroshard`` parser; argparse's error line on failure."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(args)
    except SystemExit:
        return (err.getvalue().strip().splitlines() or ["argparse failed"])[-1]


def _overrides(ns: argparse.Namespace, model: type[Any]) -> dict[str, Any]:
    """The config overrides the daemon's command applies: flags named like a field
    (listen, name, insecure, probe_port, ...) and the ``tls``/``auth`` flags."""
    out = {k: v for k, v in vars(ns).items() if k in model.model_fields}
    out.update(daemon_overrides(ns))
    return out


def _config_text(docs: list[dict[str, Any]], pod: dict[str, Any], path: str) -> str | None:
    """The text of the ConfigMap file mounted at ``path`` in the pod (None: none is)."""
    directory, _, file = path.rpartition("/")
    mount = next(
        (m for m in pod["containers"][0].get("volumeMounts", []) if m["mountPath"] == directory),
        None,
    )
    volume = next((v for v in pod.get("volumes", []) if mount and v["name"] == mount["name"]), {})
    config_map = by_kind(docs, "ConfigMap").get(volume.get("configMap", {}).get("name", ""))
    return None if config_map is None else config_map.get("data", {}).get(file)


def load_daemons(docs: list[dict[str, Any]]) -> tuple[list[Daemon], list[str]]:
    """Parse each StatefulSet's args with the real CLI and load the config the daemon would:
    its ``--config`` file from the ConfigMap, overridden by its flags."""
    daemons: list[Daemon] = []
    problems = [
        f"{d['kind']}/{d['metadata']['name']}: only the two StatefulSets may run pods "
        "(deploy-check vets nothing else)"
        for d in docs
        if d.get("kind") in OTHER_WORKLOADS
    ]
    for name, sts in by_kind(docs, "StatefulSet").items():
        pod = sts["spec"]["template"]["spec"]
        container = pod["containers"][0]
        if len(pod["containers"]) != 1 or pod.get("initContainers") or "command" in container:
            problems.append(
                f"StatefulSet/{name}: expected one container running the image's entrypoint "
                "(no other containers, initContainers or command)"
            )
            continue
        args, undefined = _expand_env(container, sts["metadata"].get("namespace", "default"))
        problems += [f"StatefulSet/{name}: args use $({v}), not in the env" for v in undefined]
        ns = _parse_args(args)
        if isinstance(ns, str):
            problems.append(f"StatefulSet/{name}: args: {ns}")
            continue
        model = MODELS.get(ns.command)
        text = _config_text(docs, pod, ns.config or "")
        if model is None or text is None:
            problems.append(
                f"StatefulSet/{name}: expected a daemon with a --config file from "
                f"a mounted ConfigMap, got {' '.join(args)}"
            )
            continue
        problems += [f"StatefulSet/{name}: {p}" for p in _trust_problems(text, ns)]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / Path(ns.config).name
            path.write_text(text)
            try:
                config = load_config(model, path, **_overrides(ns, model))
            except ConfigError as exc:
                problems.append(f"StatefulSet/{name}: {exc}".replace(f"{path}: ", ""))
                continue
        daemons.append(Daemon(name, ns.command, sts, config))
    commands = sorted(d.command for d in daemons)
    if not problems and commands != ["coordinator", "worker"]:
        problems.append(f"expected one coordinator and one worker StatefulSet, got {commands}")
    return daemons, problems


def _trust_problems(text: str, ns: argparse.Namespace) -> list[str]:
    """Settings of the shared-secret trust model, refused in the config file as written
    (whether or not the config model still knows them) and in the flags."""
    raw = yaml.safe_load(text)
    raw = raw if isinstance(raw, dict) else {}
    tls, auth = raw.get("tls") or {}, raw.get("auth") or {}
    problems = []
    if isinstance(tls, dict) and "server_name" in tls:
        problems.append(
            "tls.server_name is set: each dialer checks the host it dials against the "
            "peer's certificate (a shared name lets any certificate stand for any daemon)"
        )
    if (isinstance(auth, dict) and auth.get("token_file")) or getattr(ns, "auth_token_file", None):
        problems.append(
            "auth.token_file is set: daemons authenticate each other by their certificates "
            "and present no token (remove it and its Secret)"
        )
    return problems


def security_problems(d: Daemon) -> list[str]:
    """TLS and auth on, insecure off, the private key on the coordinator only, a worker's
    name bound to its pod's name."""
    cfg, problems = d.config, []
    if cfg.tls is None:
        problems.append("runs without tls (mutual TLS): set tls in its config")
    if cfg.auth is None:
        problems.append("runs without auth (tokens): set auth in its config")
    if cfg.insecure:
        problems.append("runs with insecure: true (config or --insecure)")
    if is_loopback(cfg.listen.rpartition(":")[0]):
        problems.append(f"listen {cfg.listen} is loopback: no other pod can reach it")
    auth = cfg.auth
    if auth is not None and d.command == "coordinator" and not auth.private_key_file:
        problems.append("auth.private_key_file is not set: the coordinator signs the tokens")
    if auth is not None and d.command == "worker" and auth.private_key_file:
        problems.append("auth.private_key_file is set: a worker must never hold it")
    if isinstance(cfg, WorkerConfig) and cfg.name != POD_NAME_SAMPLE:
        problems.append(
            f"name {cfg.name} is not the pod's name: pass --name=$(POD_NAME) with POD_NAME "
            "from the downward API (fieldRef metadata.name), the name its certificate holds"
        )
    return [f"StatefulSet/{d.name}: {p}" for p in problems]


def config_files(d: Daemon) -> dict[str, str]:
    """The files the daemon's tls and auth sections name, by config key."""
    files: dict[str, str] = {}
    for section in ("tls", "auth"):
        value = getattr(d.config, section)
        if value is not None:
            for key, path in value.model_dump().items():
                if key.endswith("_file") and path:
                    files[f"{section}.{key}"] = path
    return files


def volume_of(d: Daemon, key: str, path: str) -> tuple[dict[str, Any] | None, str, str]:
    """The volume whose read-only mount holds ``path`` (the deepest mount containing it): a
    Secret, or for the ``tls.*`` files a csi volume; the path inside that volume, and why
    not when the volume is None."""
    volumes = {v["name"]: v for v in d.pod.get("volumes", [])}
    mounts = [
        m
        for m in d.container.get("volumeMounts", [])
        if path.startswith(m["mountPath"].rstrip("/") + "/")
    ]
    if not mounts:
        return None, "", "is in no volume mount (the daemon would not find it)"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    root = mount["mountPath"].rstrip("/")
    volume = volumes.get(mount["name"], {})
    if "secret" not in volume and not ("csi" in volume and key.startswith("tls.")):
        return None, "", f"is in {root}, which is not a Secret volume"
    if not mount.get("readOnly"):
        return None, "", f"is in {root}, which is not mounted readOnly"
    return volume, path[len(root) + 1 :], ""


def _csi_file_problems(d: Daemon, volume: dict[str, Any], file: str) -> list[str]:
    """A TLS file in a csi volume: cert-manager's driver, read-only, a file it writes, and
    its files (0440, root-owned) given the group the non-root user is in."""
    csi, problems = volume["csi"], []
    attrs = csi.get("volumeAttributes") or {}
    if csi.get("driver") != CSI_DRIVER:
        return [f"volume {volume['name']} is a csi volume of {csi.get('driver')}, not {CSI_DRIVER}"]
    if not csi.get("readOnly"):
        problems.append(f"csi volume {volume['name']} is not readOnly (the driver requires it)")
    files = {attrs.get(k, default) for k, default in CSI_FILES.items()}
    if file not in files:
        problems.append(f"csi volume {volume['name']} holds {', '.join(sorted(files))}, not {file}")
    group = d.pod.get("securityContext", {}).get("fsGroup")
    if attrs.get(f"{CSI_DRIVER}/fs-group") != str(group):
        problems.append(
            f"csi volume {volume['name']}: {CSI_DRIVER}/fs-group is not the pod's fsGroup "
            f"{group} (its files are 0440, root-owned: the daemon could not read them)"
        )
    return problems


def _secret_file_problems(volume: dict[str, Any], file: str) -> list[str]:
    secret = volume["secret"]
    problems = []
    if secret.get("optional"):
        problems.append(f"Secret {secret['secretName']} is optional (pods would start without it)")
    items = secret.get("items")
    item = next((i for i in items or [] if i["path"] == file), None)
    if items is not None and item is None:
        problems.append(f"Secret {secret['secretName']}'s items do not include {file}")
    if items is None:
        problems.append(
            f"Secret {secret['secretName']} is mounted whole: list its items (deploy-check "
            "vets only the keys a pod is given)"
        )
    mode = (item or {}).get("mode", secret.get("defaultMode", 0o644))
    if mode not in SECRET_MODES:
        problems.append(f"mode {mode:#o}, expected 0400 or 0440")
    return problems


def _token_mounts(d: Daemon) -> list[str]:
    """The daemon's Secret volumes that project a key named like a token."""
    problems = []
    for volume in d.pod.get("volumes", []):
        secret = volume.get("secret")
        for item in (secret or {}).get("items") or []:
            names = (item["key"].lower(), item["path"].lower())
            if any(fnmatch.fnmatch(n, pattern) for n in names for pattern in TOKEN_KEYS):
                problems.append(
                    f"StatefulSet/{d.name}: mounts Secret {secret['secretName']}'s key "
                    f"{item['key']}: daemons present no token (they authenticate each other "
                    "by their certificates)"
                )
    return problems


def secret_problems(daemons: list[Daemon]) -> list[str]:
    """Each tls/auth file in a read-only, non-optional Secret mount with mode 0400/0440 and
    listed items (or a TLS file in a cert-manager csi volume); the private key's Secret
    mounted in the coordinator only; no token mounted; fsGroup set."""
    problems, private_secrets = [], set()
    for d in daemons:
        ctx = d.pod.get("securityContext", {})
        if not ctx.get("runAsNonRoot") or ctx.get("fsGroup") is None:
            problems.append(
                f"StatefulSet/{d.name}: needs runAsNonRoot and an fsGroup (the secrets' "
                "files are root-owned with group fsGroup)"
            )
        for key, path in config_files(d).items():
            volume, inside, why = volume_of(d, key, path)
            if volume is None:
                found = [why]
            elif "csi" in volume:
                found = _csi_file_problems(d, volume, inside)
            else:
                found = _secret_file_problems(volume, inside)
            problems += [f"StatefulSet/{d.name}: {key} {path}: {p}" for p in found if p]
            if volume is not None and key == "auth.private_key_file" and "secret" in volume:
                private_secrets.add(volume["secret"]["secretName"])
        problems += _token_mounts(d)
    for d in daemons:
        if d.command == "coordinator":
            continue
        for volume in d.pod.get("volumes", []):
            name = volume.get("secret", {}).get("secretName")
            if name in private_secrets:
                problems.append(
                    f"StatefulSet/{d.name}: mounts Secret {name}, which holds the "
                    "coordinator's token-signing private key"
                )
    return problems


def _selects(service: dict[str, Any], d: Daemon) -> bool:
    selector = service["spec"].get("selector") or {}
    same_ns = service["metadata"].get("namespace", "default") == d.namespace
    return same_ns and bool(selector) and selector.items() <= d.labels.items()


def _target(service_port: dict[str, Any], d: Daemon) -> int | None:
    """The container port a Service port leads to on the daemon's pods (None: no such)."""
    target = service_port.get("targetPort", service_port["port"])
    if isinstance(target, str):
        return d.port(target)
    numbers = {int(p["containerPort"]) for p in d.container.get("ports", [])}
    return target if target in numbers else None


def _port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def _probe_problems(d: Daemon) -> list[str]:
    probe_port, problems = d.config.probe_port, []
    if probe_port is None:
        return ["probe_port is not set: the kubelet cannot probe a mutual-TLS port"]
    if probe_port != d.port("probe"):
        problems.append(f"probe_port {probe_port} is not the container port probe")
    if probe_port == _port_of(d.config.listen):
        problems.append("probe_port is the listen port: it must be a separate plaintext port")
    for kind in PROBES:
        grpc = d.container.get(kind, {}).get("grpc")
        if grpc is not None and grpc.get("port") != probe_port:
            problems.append(f"{kind} probes port {grpc.get('port')}, not probe_port {probe_port}")
    return problems


def _metrics_problems(d: Daemon) -> list[str]:
    cfg, problems = d.config, []
    declared = d.port("metrics")
    if cfg.metrics_port != declared:
        problems.append(f"metrics_port {cfg.metrics_port} is not the container port metrics")
    if cfg.metrics_port is not None and is_loopback(cfg.metrics_host):
        problems.append(f"metrics_host {cfg.metrics_host} is loopback: Prometheus cannot scrape")
    annotated = d.sts["spec"]["template"]["metadata"].get("annotations", {})
    if "prometheus.io/port" in annotated and annotated["prometheus.io/port"] != str(
        cfg.metrics_port
    ):
        problems.append(f"annotation prometheus.io/port is not metrics_port {cfg.metrics_port}")
    return problems


def _service_problems(d: Daemon, services: dict[str, dict[str, Any]]) -> list[str]:
    problems, reaches_grpc = [], False
    listen_port = _port_of(d.config.listen)
    for name, svc in services.items():
        if not _selects(svc, d):
            continue
        for port in svc["spec"].get("ports", []):
            target = _target(port, d)
            if target is None:
                problems.append(
                    f"Service/{name} port {port['port']} targets {port.get('targetPort')}, "
                    "which is no container port"
                )
            reaches_grpc |= target == listen_port
    if not reaches_grpc:
        problems.append(f"no Service port leads to the gRPC port (listen {d.config.listen})")
    return problems


def _worker_address_problems(
    d: Daemon, daemons: list[Daemon], services: dict[str, dict[str, Any]]
) -> list[str]:
    """The coordinator address leads to the coordinator's gRPC port; the advertised host is
    a pod name under the StatefulSet's headless Service."""
    cfg = d.config
    assert isinstance(cfg, WorkerConfig)
    problems = []
    host, _, port = cfg.coordinator.rpartition(":")
    svc = services.get(host.split(".")[0])
    coordinators = [c for c in daemons if c.command == "coordinator"]
    reached = [
        c
        for c in coordinators
        if svc is not None
        and _selects(svc, c)
        and any(
            p["port"] == int(port) and _target(p, c) == _port_of(c.config.listen)
            for p in svc["spec"].get("ports", [])
        )
    ]
    if not reached:
        problems.append(
            f"coordinator {cfg.coordinator} does not lead to the coordinator's gRPC port "
            "through a Service"
        )
    service_name = d.sts["spec"].get("serviceName")
    labels = (cfg.advertise_host or "").split(".")
    headless = services.get(service_name or "", {}).get("spec", {}).get("clusterIP") == "None"
    if len(labels) < 2 or labels[1] != service_name or not headless:
        problems.append(
            f"advertise_host {cfg.advertise_host} is not POD.{service_name}.NAMESPACE.svc "
            "of a headless Service"
        )
    return problems


def port_problems(daemons: list[Daemon], docs: list[dict[str, Any]]) -> list[str]:
    """listen, probe_port and metrics_port against the container ports, probes, annotation
    and Services; a worker's coordinator and advertise_host against the Services."""
    services = by_kind(docs, "Service")
    problems = []
    for d in daemons:
        found = []
        if d.config.listen.rpartition(":")[2] in ("0", "") or d.port("grpc") != _port_of(
            d.config.listen
        ):
            found.append(f"listen {d.config.listen} is not on the container port grpc")
        found += _probe_problems(d) + _metrics_problems(d) + _service_problems(d, services)
        if d.command == "worker":
            found += _worker_address_problems(d, daemons, services)
        problems += [f"StatefulSet/{d.name}: {p}" for p in found]
    return problems


def daemon_problems(docs: list[dict[str, Any]]) -> tuple[list[Daemon], list[str]]:
    """Load every daemon and run every check of this module; the daemons and the problems."""
    daemons, problems = load_daemons(docs)
    for d in daemons:
        problems += security_problems(d)
    problems += secret_problems(daemons) + port_problems(daemons, docs)
    return daemons, problems
