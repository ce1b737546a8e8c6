"""deploy/check.py refuses a rendered overlay that would run a daemon unprotected or
inconsistently: each test breaks one thing in the real dev overlay and expects the problem.

Renders with ``kubectl kustomize`` (local, no cluster); skipped without kubectl, in which
case ``make deploy-check`` itself fails and says so.
"""

from __future__ import annotations

import copy
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
sys.path.insert(0, str(DEPLOY))

import check  # noqa: E402  (deploy/check.py is a script, not a package)
import check_network  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl")

Docs = list[dict[str, Any]]


@pytest.fixture(scope="module")
def rendered() -> dict[str, Docs]:
    return {o.name: check.render(o) for o in (check.K8S / "overlays").iterdir() if o.is_dir()}


@pytest.fixture
def dev(rendered: dict[str, Docs]) -> Docs:
    return copy.deepcopy(rendered["dev"])


def _one(docs: Docs, kind: str, name: str | None = None) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"]))


def _edit_config(docs: Docs, file: str, edit: Callable[[dict[str, Any]], None]) -> None:
    data = _one(docs, "ConfigMap")["data"]
    config = yaml.safe_load(data[file])
    edit(config)
    data[file] = yaml.safe_dump(config)


def _container(docs: Docs, sts: str) -> dict[str, Any]:
    return _one(docs, "StatefulSet", sts)["spec"]["template"]["spec"]["containers"][0]


def _problems(docs: Docs) -> str:
    return "\n".join(check.manifest_problems("dev", docs))


def test_every_overlay_passes(rendered: dict[str, Docs]) -> None:
    for overlay, docs in rendered.items():
        assert check.manifest_problems(overlay, docs) == [], overlay


@pytest.mark.parametrize("daemon", ["coordinator", "worker"])
@pytest.mark.parametrize("section", ["tls", "auth"])
def test_a_daemon_without_tls_or_auth_is_rejected(dev: Docs, daemon: str, section: str) -> None:
    _edit_config(dev, f"{daemon}.yaml", lambda c: c.pop(section))

    assert f"StatefulSet/neuroshard-{daemon}: runs without {section}" in _problems(dev)


@pytest.mark.parametrize("daemon", ["coordinator", "worker"])
def test_insecure_in_the_config_is_rejected(dev: Docs, daemon: str) -> None:
    _edit_config(dev, f"{daemon}.yaml", lambda c: c.update(insecure=True))

    assert f"StatefulSet/neuroshard-{daemon}: runs with insecure: true" in _problems(dev)


def test_insecure_flag_is_rejected(dev: Docs) -> None:
    _container(dev, "neuroshard-worker")["args"].append("--insecure")

    assert "StatefulSet/neuroshard-worker: runs with insecure: true" in _problems(dev)


def test_tls_and_auth_given_as_flags_count(dev: Docs) -> None:
    _edit_config(dev, "coordinator.yaml", lambda c: c.pop("tls"))
    _container(dev, "neuroshard-coordinator")["args"] += [
        "--tls-ca=/etc/neuroshard-trust/ca.crt",
        "--tls-cert=/etc/neuroshard-tls/tls.crt",
        "--tls-key=/etc/neuroshard-tls/tls.key",
    ]

    assert _problems(dev) == ""


def test_a_loopback_listen_flag_is_rejected(dev: Docs) -> None:
    _container(dev, "neuroshard-coordinator")["args"].append("--listen=127.0.0.1:50051")

    assert "listen 127.0.0.1:50051 is loopback" in _problems(dev)


def test_workloads_the_check_cannot_vet_are_rejected(dev: Docs) -> None:
    sts = _one(dev, "StatefulSet", "neuroshard-worker")
    dev.append({"kind": "Deployment", "metadata": {"name": "extra"}, "spec": sts["spec"]})
    _container(dev, "neuroshard-coordinator")["command"] = ["sh", "-c"]

    problems = _problems(dev)
    assert "Deployment/extra: only the two StatefulSets may run pods" in problems
    assert "StatefulSet/neuroshard-coordinator: expected one container" in problems


def test_the_private_key_on_a_worker_is_rejected(dev: Docs) -> None:
    pod = _one(dev, "StatefulSet", "neuroshard-worker")["spec"]["template"]["spec"]
    auth = next(v for v in pod["volumes"] if v["name"] == "auth")
    auth["secret"]["secretName"] = "neuroshard-auth-coordinator"
    _edit_config(
        dev,
        "worker.yaml",
        lambda c: c["auth"].update(private_key_file="/etc/neuroshard-auth/private.pem"),
    )

    problems = _problems(dev)
    assert "auth.private_key_file is set: a worker must never hold it" in problems
    assert "mounts Secret neuroshard-auth-coordinator" in problems


def test_optional_or_world_readable_secrets_are_rejected(dev: Docs) -> None:
    pod = _one(dev, "StatefulSet", "neuroshard-coordinator")["spec"]["template"]["spec"]
    tls = next(v for v in pod["volumes"] if v["name"] == "tls")
    tls["secret"].update(optional=True, defaultMode=0o644)

    problems = _problems(dev)
    assert "Secret neuroshard-coordinator-tls is optional" in problems
    assert "mode 0o644, expected 0400 or 0440" in problems


def test_a_file_outside_the_secret_mounts_is_rejected(dev: Docs) -> None:
    _edit_config(dev, "worker.yaml", lambda c: c["tls"].update(key_file="/data/tls.key"))
    _edit_config(dev, "coordinator.yaml", lambda c: c["tls"].update(ca_file="/srv/ca.crt"))

    problems = _problems(dev)
    assert "tls.key_file /data/tls.key: is in /data, which is not a Secret volume" in problems
    assert "tls.ca_file /srv/ca.crt: is in no volume mount" in problems


def test_a_file_the_secret_items_do_not_project_is_rejected(dev: Docs) -> None:
    _edit_config(
        dev, "worker.yaml", lambda c: c["auth"].update(public_key_file="/etc/neuroshard-auth/k")
    )

    assert "Secret neuroshard-auth-public's items do not include k" in _problems(dev)


def test_probes_on_the_tls_port_are_rejected(dev: Docs) -> None:
    _container(dev, "neuroshard-worker")["livenessProbe"]["grpc"]["port"] = 50052

    assert "livenessProbe probes port 50052, not probe_port 50060" in _problems(dev)


def test_a_config_without_probe_port_is_rejected(dev: Docs) -> None:
    _edit_config(dev, "coordinator.yaml", lambda c: c.pop("probe_port"))

    assert "probe_port is not set" in _problems(dev)


def test_ports_that_disagree_with_the_config_are_rejected(dev: Docs) -> None:
    _edit_config(dev, "coordinator.yaml", lambda c: c.update(listen="0.0.0.0:6000"))
    _edit_config(dev, "worker.yaml", lambda c: c.update(metrics_host="127.0.0.1"))

    problems = _problems(dev)
    assert "listen 0.0.0.0:6000 is not on the container port grpc" in problems
    assert "no Service port leads to the gRPC port" in problems
    assert "coordinator neuroshard-coordinator:50051 does not lead to" in problems
    assert "metrics_host 127.0.0.1 is loopback" in problems


def test_without_the_default_deny_egress_is_open(dev: Docs) -> None:
    dev.remove(_one(dev, "NetworkPolicy", "neuroshard-default-deny"))
    for policy in (d for d in dev if d["kind"] == "NetworkPolicy"):
        policy["spec"]["policyTypes"] = ["Ingress"]

    problems = _problems(dev)
    assert "no NetworkPolicy with policyTypes Egress selects its pods" in problems
    assert "coordinator -> the internet TCP 443 must be denied, but is allowed" in problems


def test_without_the_dns_policy_names_do_not_resolve(dev: Docs) -> None:
    dev.remove(_one(dev, "NetworkPolicy", "neuroshard-dns"))

    assert "worker -> kube-dns UDP 53 must be allowed; denied by worker's egress" in _problems(dev)


def test_worker_egress_to_the_coordinator_is_required(dev: Docs) -> None:
    _one(dev, "NetworkPolicy", "neuroshard-worker")["spec"]["egress"] = []

    assert "worker -> coordinator TCP 50051 must be allowed; denied by worker's egress" in (
        _problems(dev)
    )


def test_selectors_follow_the_kubernetes_semantics() -> None:
    labels = {"app": "a", "tier": "db"}
    match = check_network.selector_matches

    assert match({}, labels) and match(None, labels)
    assert match({"matchLabels": {"app": "a"}}, labels)
    assert not match({"matchLabels": {"app": "b"}}, labels)
    assert match(
        {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["db"]}]}, labels
    )
    assert not match({"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}, labels)
    assert match({"matchExpressions": [{"key": "x", "operator": "NotIn", "values": ["y"]}]}, labels)


def _pod(docs: Docs, sts: str) -> dict[str, Any]:
    return _one(docs, "StatefulSet", sts)["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def _volume(docs: Docs, sts: str, name: str) -> dict[str, Any]:
    return next(v for v in _pod(docs, sts)["volumes"] if v["name"] == name)


def _csi(docs: Docs) -> dict[str, str]:
    attrs = _volume(docs, "neuroshard-worker", "tls")["csi"]["volumeAttributes"]
    return attrs  # type: ignore[no-any-return]


CSI = "csi.cert-manager.io/"


def test_a_tls_key_secret_shared_by_the_coordinator_and_workers_is_rejected(dev: Docs) -> None:
    coordinator_tls = _volume(dev, "neuroshard-coordinator", "tls")
    worker_tls = _volume(dev, "neuroshard-worker", "tls")
    worker_tls.pop("csi")
    worker_tls["secret"] = copy.deepcopy(coordinator_tls["secret"])

    problems = _problems(dev)
    assert (
        "StatefulSet/neuroshard-worker: tls.key_file is in Secret neuroshard-coordinator-tls, "
        "which every pod of the StatefulSet shares" in problems
    )
    assert (
        "StatefulSet/neuroshard-worker: mounts Secret neuroshard-coordinator-tls, which holds "
        "StatefulSet/neuroshard-coordinator's TLS key" in problems
    )


def test_a_worker_certificate_naming_another_worker_is_rejected(dev: Docs) -> None:
    _csi(dev)[CSI + "uri-sans"] = "spiffe://neuroshard/worker/neuroshard-worker-0"

    assert (
        "StatefulSet/neuroshard-worker: csi volume tls: its URI SANs are "
        "spiffe://neuroshard/worker/neuroshard-worker-0, not exactly "
        "spiffe://neuroshard/worker/${POD_NAME}" in _problems(dev)
    )


def test_a_worker_certificate_with_a_second_identity_is_rejected(dev: Docs) -> None:
    _csi(dev)[CSI + "uri-sans"] += ",spiffe://neuroshard/coordinator"

    assert (
        "its URI SANs are spiffe://neuroshard/worker/${POD_NAME}, spiffe://neuroshard/coordinator, "
        "not exactly spiffe://neuroshard/worker/${POD_NAME}" in _problems(dev)
    )


def test_a_worker_certificate_without_its_advertised_host_is_rejected(dev: Docs) -> None:
    _csi(dev)[CSI + "dns-names"] = (
        "${POD_NAME}.neuroshard-worker.${POD_NAMESPACE}.svc.cluster.local"
    )

    assert (
        "csi volume tls: $(POD_NAME).neuroshard-worker.neuroshard-dev.svc (its advertise_host) "
        "is not among its DNS names and IPs" in _problems(dev)
    )


@pytest.mark.parametrize(
    "edit",
    [
        lambda c: c["args"].__setitem__(2, "--name=neuroshard-worker-0"),
        lambda c: c["env"][0]["valueFrom"]["fieldRef"].update(fieldPath="spec.nodeName"),
    ],
    ids=["literal", "not-metadata.name"],
)
def test_a_worker_name_other_than_its_pod_name_is_rejected(
    dev: Docs, edit: Callable[[dict[str, Any]], None]
) -> None:
    container = _container(dev, "neuroshard-worker")
    assert container["args"][2] == "--name=$(POD_NAME)"
    edit(container)

    problems = _problems(dev)
    assert "StatefulSet/neuroshard-worker: name " in problems
    assert "is not the pod's name: pass --name=$(POD_NAME)" in problems
    # and the certificate's URI is then not the name it registers
    assert "its URI SANs are spiffe://neuroshard/worker/${POD_NAME}, not exactly" in problems
    assert "(the name the worker registers)" in problems


@pytest.mark.parametrize("sts", ["neuroshard-coordinator", "neuroshard-worker"])
def test_a_pod_with_a_service_account_token_is_rejected(dev: Docs, sts: str) -> None:
    _pod(dev, sts).pop("automountServiceAccountToken")

    assert f"StatefulSet/{sts}: automountServiceAccountToken is not false" in _problems(dev)


@pytest.mark.parametrize("sts", ["neuroshard-coordinator", "neuroshard-worker"])
def test_an_empty_dir_without_size_limit_is_rejected(dev: Docs, sts: str) -> None:
    _volume(dev, sts, "tmp")["emptyDir"] = {}

    assert f"StatefulSet/{sts}: emptyDir volume tmp has no sizeLimit" in _problems(dev)


def test_a_worker_token_configured_is_rejected(dev: Docs) -> None:
    _edit_config(
        dev, "worker.yaml", lambda c: c["auth"].update(token_file="/etc/neuroshard-auth/token")
    )

    assert "StatefulSet/neuroshard-worker: auth.token_file is set: daemons authenticate" in (
        _problems(dev)
    )


def test_a_worker_token_mounted_is_rejected(dev: Docs) -> None:
    _volume(dev, "neuroshard-worker", "auth")["secret"]["items"].append(
        {"key": "token", "path": "token"}
    )

    assert (
        "StatefulSet/neuroshard-worker: mounts Secret neuroshard-auth-public's key token: "
        "daemons present no token" in _problems(dev)
    )


def test_a_token_file_flag_is_rejected(dev: Docs) -> None:
    _container(dev, "neuroshard-worker")["args"] += ["--auth-token-file=/etc/t"]

    assert (
        "StatefulSet/neuroshard-worker: args: neuroshard: error: unrecognized arguments: "
        "--auth-token-file=/etc/t" in _problems(dev)
    )


@pytest.mark.parametrize("daemon", ["coordinator", "worker"])
def test_server_name_in_a_daemon_config_is_rejected(dev: Docs, daemon: str) -> None:
    _edit_config(dev, f"{daemon}.yaml", lambda c: c["tls"].update(server_name="neuroshard"))

    assert f"StatefulSet/neuroshard-{daemon}: tls.server_name is set: each dialer checks" in (
        _problems(dev)
    )


def test_a_secret_mounted_whole_is_rejected(dev: Docs) -> None:
    _volume(dev, "neuroshard-worker", "auth")["secret"].pop("items")

    assert "Secret neuroshard-auth-public is mounted whole: list its items" in _problems(dev)


def test_a_csi_volume_the_daemon_cannot_use_is_rejected(dev: Docs) -> None:
    tls = _volume(dev, "neuroshard-worker", "tls")
    tls["csi"]["readOnly"] = False
    tls["csi"]["volumeAttributes"].pop(CSI + "fs-group")
    tls["csi"]["volumeAttributes"][CSI + "privatekey-file"] = "key.pem"
    tls["csi"]["volumeAttributes"][CSI + "uri-san"] = "typo"
    tls["csi"]["volumeAttributes"].pop(CSI + "issuer-name")

    problems = _problems(dev)
    assert "csi volume tls is not readOnly" in problems
    assert "fs-group is not the pod's fsGroup 10001" in problems
    assert (
        "tls.key_file /etc/neuroshard-tls/tls.key: csi volume tls holds ca.crt, key.pem, "
        "tls.crt, not tls.key" in problems
    )
    assert "csi volume tls: unknown attribute csi.cert-manager.io/uri-san" in problems
    assert "csi volume tls: names no issuer" in problems


def test_a_worker_certificate_without_client_auth_is_rejected(dev: Docs) -> None:
    _csi(dev).pop(CSI + "key-usages")

    assert "csi volume tls: usages lack server auth and client auth" in _problems(dev)


def test_the_coordinator_certificate_must_name_it_and_its_service(dev: Docs) -> None:
    spec = _one(dev, "Certificate", "neuroshard-coordinator")["spec"]
    spec["uris"] = ["spiffe://neuroshard/worker/neuroshard-worker-0"]
    spec["dnsNames"] = ["neuroshard-coordinator.NAMESPACE.svc"]
    spec["usages"] = ["server auth"]

    problems = _problems(dev)
    prefix = (
        "StatefulSet/neuroshard-coordinator: Certificate/neuroshard-coordinator "
        "(Secret neuroshard-coordinator-tls): "
    )
    assert prefix + "its URI SANs are spiffe://neuroshard/worker/neuroshard-worker-0, " in problems
    assert (
        prefix + "neuroshard-coordinator (StatefulSet/neuroshard-worker's coordinator) is not "
        "among its DNS names" in problems
    )
    assert prefix + "DNS name neuroshard-coordinator.NAMESPACE.svc names namespace NAMESPACE" in (
        problems
    )
    assert prefix + "usages lack client auth" in problems


def test_a_coordinator_key_in_a_secret_no_certificate_keeps_is_rejected(dev: Docs) -> None:
    _one(dev, "Certificate", "neuroshard-coordinator")["spec"]["secretName"] = "other"

    assert (
        "StatefulSet/neuroshard-coordinator: Secret neuroshard-coordinator-tls: is kept by no "
        "Certificate" in _problems(dev)
    )


def test_cert_manager_objects_are_checked_without_a_schema(dev: Docs) -> None:
    certificate = _one(dev, "Certificate", "neuroshard-coordinator")
    certificate["spec"].pop("secretName")
    certificate["spec"]["usages"].append("server")
    certificate["spec"]["dnsName"] = ["typo"]
    certificate["spec"]["issuerRef"]["name"] = "missing"
    _one(dev, "Issuer", "neuroshard-ca")["spec"] = {"ca": {}}

    problems = _problems(dev)
    assert "Certificate/neuroshard-coordinator: unknown field spec.dnsName" in problems
    assert "Certificate/neuroshard-coordinator: spec.secretName is required" in problems
    assert "Certificate/neuroshard-coordinator: spec.usages: unknown usage 'server'" in problems
    assert "spec.issuerRef names Issuer/missing, not in the manifests" in problems
    assert "Issuer/neuroshard-ca: spec.ca.secretName is required" in problems


def test_only_cert_manager_v1_kinds_skip_the_schemas(dev: Docs) -> None:
    objects = [d for d in dev if d["kind"] in ("Certificate", "Issuer")]
    assert check.schema_problems(objects, [check.MIN_KUBERNETES]) == []

    objects[0]["apiVersion"] = "cert-manager.io/v1alpha2"
    problems = "\n".join(check.schema_problems(objects, [check.MIN_KUBERNETES]))
    problems += "\n" + "\n".join(check.manifest_problems("dev", dev))
    assert (
        f"{objects[0]['kind']}/{objects[0]['metadata']['name']} (Kubernetes 1.27.0): no schema"
        in problems
    )
    assert "apiVersion cert-manager.io/v1alpha2, expected cert-manager.io/v1" in problems


def test_the_pods_cannot_reach_the_kubernetes_api(dev: Docs) -> None:
    policy = _one(dev, "NetworkPolicy", "neuroshard-worker")
    policy["spec"]["egress"].append({"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]})

    assert "worker -> the Kubernetes API server TCP 443 must be denied, but is allowed" in (
        _problems(dev)
    )
