"""Deploy-check of the NetworkPolicies: evaluate them for the paths the cluster needs and for
paths that must stay closed.

A small evaluator of the Kubernetes NetworkPolicy semantics (networking.k8s.io/v1): a
connection from A to B's port is allowed when A's egress and B's ingress both allow it; a pod
selected by no policy of a direction is open in that direction; otherwise some rule of a
policy selecting it must match the peer (podSelector in the policy's namespace,
namespaceSelector, both, or ipBlock) and the port (number, or a container port's name
resolved on the destination pod; protocol TCP unless given; endPort). Label selectors
support matchLabels and matchExpressions (In, NotIn, Exists, DoesNotExist).

Pods are the StatefulSets' pod templates with their config's ports (``check_daemons``);
the other ends are stand-ins: kube-dns in kube-system, a labelled client pod and a pod of a
labelled namespace, a labelled Prometheus in another namespace, an unlabelled pod, an
address on the internet, and the Kubernetes API server (the daemons never call it: their pods
hold no service-account token either).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from check_daemons import Daemon, by_kind


@dataclass(frozen=True)
class Endpoint:
    """One end of a connection: a pod (labels, namespace and its labels, named ports) or,
    with ``ip`` set and no namespace, an address outside the cluster."""

    what: str
    labels: dict[str, str] = field(default_factory=dict)
    namespace: str | None = None
    namespace_labels: dict[str, str] = field(default_factory=dict)
    ports: dict[str, tuple[int, str]] = field(default_factory=dict)  # name -> (port, protocol)
    ip: str = "10.0.0.1"


def selector_matches(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """Whether a LabelSelector matches ``labels`` (an empty selector matches everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }.get(op, False)
        if not ok:
            return False
    return True


def _peer_matches(peer: dict[str, Any], policy_ns: str, ep: Endpoint) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        ip = ipaddress.ip_address(ep.ip)
        inside = ip in ipaddress.ip_network(block["cidr"])
        return inside and not any(ip in ipaddress.ip_network(e) for e in block.get("except", []))
    if ep.namespace is None:  # outside the cluster: only ipBlocks match
        return False
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], ep.namespace_labels):
            return False
    elif ep.namespace != policy_ns:
        return False
    return "podSelector" not in peer or selector_matches(peer["podSelector"], ep.labels)


def policy_types(policy: dict[str, Any]) -> list[str]:
    """The directions a policy isolates: its policyTypes, or by default Ingress, plus Egress
    when it has egress rules."""
    spec = policy["spec"]
    return spec.get("policyTypes") or ["Ingress"] + (["Egress"] if "egress" in spec else [])


def _port_matches(ports: list[dict[str, Any]] | None, dst: Endpoint, port: int, proto: str) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != proto:
            continue
        number = p.get("port")
        if number is None:
            return True
        if isinstance(number, str):
            named = dst.ports.get(number)
            if named is not None and named == (port, proto):
                return True
        elif number <= port <= p.get("endPort", number):
            return True
    return False


def allows(
    policies: list[dict[str, Any]],
    direction: str,
    subject: Endpoint,
    peer: Endpoint,
    dst: Endpoint,
    port: int,
    proto: str,
) -> bool:
    """Whether ``subject``'s policies of ``direction`` (Ingress, Egress) admit ``peer``;
    ``dst`` is the connection's destination (whose named ports resolve), ``port`` its port."""
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    selecting = [
        p
        for p in policies
        if subject.namespace is not None
        and p["metadata"].get("namespace", "default") == subject.namespace
        and selector_matches(p["spec"].get("podSelector"), subject.labels)
        and direction in policy_types(p)
    ]
    if subject.namespace is None or not selecting:
        return True  # not a pod of ours, or not isolated in this direction
    for policy in selecting:
        ns = policy["metadata"].get("namespace", "default")
        for rule in policy["spec"].get(key) or []:
            peers = rule.get(peers_key) or []
            if (not peers or any(_peer_matches(x, ns, peer) for x in peers)) and _port_matches(
                rule.get("ports"), dst, port, proto
            ):
                return True
    return False


def connection_allowed(
    policies: list[dict[str, Any]], src: Endpoint, dst: Endpoint, port: int, proto: str = "TCP"
) -> tuple[bool, bool]:
    """(egress of src allows it, ingress of dst allows it)."""
    return (
        allows(policies, "Egress", src, dst, dst, port, proto),
        allows(policies, "Ingress", dst, src, dst, port, proto),
    )


def pod_endpoint(d: Daemon, docs: list[dict[str, Any]]) -> Endpoint:
    """The daemon's pods as an endpoint: template labels, namespace, named container ports."""
    namespace = by_kind(docs, "Namespace").get(d.namespace, {})
    ns_labels = {
        **namespace.get("metadata", {}).get("labels", {}),
        "kubernetes.io/metadata.name": d.namespace,
    }
    ports = {
        p["name"]: (int(p["containerPort"]), p.get("protocol", "TCP"))
        for p in d.container.get("ports", [])
        if "name" in p
    }
    return Endpoint(d.command, dict(d.labels), d.namespace, ns_labels, ports)


def _stand_ins(namespace: str) -> dict[str, Endpoint]:
    def ns(name: str, **labels: str) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": name, **labels}

    here = ns(namespace)
    return {
        "dns": Endpoint(
            "kube-dns",
            {"k8s-app": "kube-dns"},
            "kube-system",
            ns("kube-system"),
            {"dns": (53, "UDP"), "dns-tcp": (53, "TCP")},
        ),
        "client": Endpoint("a client pod", {"neuroshard/client": "true"}, namespace, here),
        "client_ns": Endpoint(
            "a pod of a client namespace", {}, "apps", ns("apps", **{"neuroshard/client": "true"})
        ),
        "scraper": Endpoint(
            "Prometheus", {"neuroshard/scraper": "true"}, "monitoring", ns("monitoring")
        ),
        "stranger": Endpoint("an unlabelled pod", {"app": "other"}, namespace, here),
        "stranger_ns": Endpoint("a pod of another namespace", {}, "other", ns("other")),
        "internet": Endpoint("the internet", ip="203.0.113.7"),
        # the API server behind the `kubernetes` Service: host-network or outside the
        # cluster, so only an ipBlock could select it (10.96.0.1: kubeadm's Service IP)
        "apiserver": Endpoint("the Kubernetes API server", ip="10.96.0.1"),
    }


Conn = tuple[Endpoint, Endpoint, int, str]  # source, destination, port, protocol


def expected_paths(
    coordinator: Endpoint, worker: Endpoint, grpc: dict[str, int], metrics: dict[str, int]
) -> tuple[list[Conn], list[Conn]]:
    """(paths that must be allowed, paths that must be denied)."""
    assert coordinator.namespace is not None
    s = _stand_ins(coordinator.namespace)
    daemons = (coordinator, worker)
    allowed: list[Conn] = [
        (worker, coordinator, grpc["coordinator"], "TCP"),
        (coordinator, worker, grpc["worker"], "TCP"),
        (worker, worker, grpc["worker"], "TCP"),
        (s["client"], coordinator, grpc["coordinator"], "TCP"),
        (s["client_ns"], coordinator, grpc["coordinator"], "TCP"),
        (s["client"], worker, grpc["worker"], "TCP"),
        # an allreduce job's process group: store and gloo on ephemeral ports
        (worker, worker, 41234, "TCP"),
    ]
    allowed += [(d, s["dns"], 53, proto) for d in daemons for proto in ("UDP", "TCP")]
    allowed += [(s["scraper"], d, metrics[d.what], "TCP") for d in daemons if metrics[d.what]]
    denied: list[Conn] = [
        (s["stranger"], coordinator, grpc["coordinator"], "TCP"),
        (s["stranger"], worker, grpc["worker"], "TCP"),
        (s["stranger_ns"], coordinator, grpc["coordinator"], "TCP"),
        (s["scraper"], coordinator, grpc["coordinator"], "TCP"),
        (s["client"], coordinator, metrics["coordinator"] or 9100, "TCP"),
        (s["client"], worker, 41234, "TCP"),
        (coordinator, worker, 41234, "TCP"),
    ]
    denied += [(d, s["internet"], 443, "TCP") for d in daemons]
    denied += [(d, s["apiserver"], port, "TCP") for d in daemons for port in (443, 6443)]
    denied += [(d, s["stranger"], 8080, "TCP") for d in daemons]
    denied += [(d, s["stranger_ns"], 53, "UDP") for d in daemons]
    return allowed, denied


def network_problems(daemons: list[Daemon], docs: list[dict[str, Any]]) -> list[str]:
    """Every needed path open, every path that must fail closed, both directions isolated."""
    policies = list(by_kind(docs, "NetworkPolicy").values())
    by_command = {d.command: d for d in daemons}
    if set(by_command) != {"coordinator", "worker"}:
        return []  # load_daemons has reported why
    eps = {name: pod_endpoint(d, docs) for name, d in by_command.items()}
    problems = []
    for d in by_command.values():
        for direction in ("Ingress", "Egress"):
            if not any(
                selector_matches(p["spec"].get("podSelector"), d.labels)
                and direction in policy_types(p)
                for p in policies
            ):
                problems.append(
                    f"StatefulSet/{d.name}: no NetworkPolicy with policyTypes {direction} "
                    f"selects its pods ({direction.lower()} is open)"
                )
    grpc = {n: int(d.config.listen.rpartition(":")[2]) for n, d in by_command.items()}
    metrics = {n: d.config.metrics_port or 0 for n, d in by_command.items()}
    allowed, denied = expected_paths(eps["coordinator"], eps["worker"], grpc, metrics)
    for src, dst, port, proto in allowed:
        egress, ingress = connection_allowed(policies, src, dst, port, proto)
        if not (egress and ingress):
            by = " and ".join(
                w
                for w, ok in ((f"{src.what}'s egress", egress), (f"{dst.what}'s ingress", ingress))
                if not ok
            )
            problems.append(
                f"NetworkPolicy: {src.what} -> {dst.what} {proto} {port} must be allowed; "
                f"denied by {by}"
            )
    for src, dst, port, proto in denied:
        if all(connection_allowed(policies, src, dst, port, proto)):
            problems.append(
                f"NetworkPolicy: {src.what} -> {dst.what} {proto} {port} must be denied, "
                "but is allowed"
            )
    return problems
