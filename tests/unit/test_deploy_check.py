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
        "--tls-ca=/etc/neuroshard-tls/ca.crt",
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
    assert "Secret neuroshard-tls is optional" in problems
    assert "mode 0o644, expected 0400 or 0440" in problems


def test_a_file_outside_the_secret_mounts_is_rejected(dev: Docs) -> None:
    _edit_config(dev, "worker.yaml", lambda c: c["tls"].update(key_file="/data/tls.key"))
    _edit_config(dev, "coordinator.yaml", lambda c: c["tls"].update(ca_file="/srv/ca.crt"))

    problems = _problems(dev)
    assert "tls.key_file /data/tls.key: is in /data, which is not a Secret volume" in problems
    assert "tls.ca_file /srv/ca.crt: is in no volume mount" in problems


def test_a_file_the_secret_items_do_not_project_is_rejected(dev: Docs) -> None:
    _edit_config(
        dev, "worker.yaml", lambda c: c["auth"].update(token_file="/etc/neuroshard-auth/jwt")
    )

    assert "Secret neuroshard-auth-worker's items do not include jwt" in _problems(dev)


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
