"""Deploy-check of the daemons' identities: each pod's own certificate, from cert-manager.

The daemons authenticate each other by their TLS client certificates: each has its own,
signed by the cluster's CA, naming it by a URI (``spiffe://neuroshard/coordinator``,
``spiffe://neuroshard/worker/NAME``) and by the hosts it is dialled at. The coordinator
accepts a worker's registration only under the name in its certificate and for a host among
its DNS names. So, for each daemon, the certificate behind ``tls.cert_file``/``key_file``:

* is its own: a worker's comes from a ``csi.cert-manager.io`` volume (one issuance per pod; a
  Secret would be shared by every pod of the StatefulSet), the coordinator's from such a
  volume or from a Secret that a cert-manager ``Certificate`` keeps, and no Secret holding
  one daemon's key is mounted by another; certificate and key come from the same volume;
* names it: exactly its URI (a worker's ``spiffe://neuroshard/worker/${POD_NAME}``, its name,
  which ``check_daemons`` binds to the pod's name), the hosts it is dialled at among its DNS
  names or IPs (a worker's advertised host; the coordinator's address in the workers'
  config), namespaced Service names in its own namespace; usages server and client auth;
* comes from an issuer in the manifests.

cert-manager's objects (Issuer, ClusterIssuer, Certificate) are custom resources whose
schemas kubernetes-validate does not ship; ``cert_manager_problems`` checks their fields
minimally instead (apiVersion, known and required fields, types, usages, durations).

Every function returns one line per problem, prefixed with the object it is about.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from check_daemons import CSI_DRIVER, POD_NAME_SAMPLE, Daemon, by_kind, volume_of

from shared.config import WorkerConfig

API_VERSION = "cert-manager.io/v1"
CERT_MANAGER_KINDS = ("Certificate", "Issuer", "ClusterIssuer")
COORDINATOR_URI = "spiffe://neuroshard/coordinator"
WORKER_URI = "spiffe://neuroshard/worker/"  # + the worker's name
NEEDED_USAGES = ("server auth", "client auth")  # each daemon serves and dials
# cert-manager's KeyUsage values (cert-manager.io/v1 Certificate spec.usages).
USAGES = frozenset(
    "signing, digital signature, content commitment, key encipherment, key agreement, "
    "data encipherment, cert sign, crl sign, encipher only, decipher only, any, server auth, "
    "client auth, code signing, email protection, s/mime, ipsec end system, ipsec tunnel, "
    "ipsec user, timestamping, ocsp signing, microsoft sgc, netscape sgc".split(", ")
)
CERTIFICATE_FIELDS = frozenset(
    "subject literalSubject commonName duration renewBefore renewBeforePercentage dnsNames "
    "ipAddresses uris otherNames emailAddresses secretName secretTemplate keystores issuerRef "
    "isCA usages privateKey signatureAlgorithm encodeUsagesInRequest revisionHistoryLimit "
    "additionalOutputFormats nameConstraints".split()
)
LIST_FIELDS = ("dnsNames", "ipAddresses", "uris", "emailAddresses", "usages")
ISSUER_TYPES = frozenset({"ca", "selfSigned", "vault", "venafi", "acme"})
# The csi-driver's volume attributes (github.com/cert-manager/csi-driver, pkg/apis/v1alpha1).
CSI_ATTRIBUTES = frozenset(
    f"{CSI_DRIVER}/{a}"
    for a in (
        "issuer-name issuer-kind issuer-group literal-subject common-name organizations "
        "organizationalunits countries provinces localities streetaddresses postalcodes "
        "serialnumber dns-names ip-sans uri-sans duration is-ca key-usages key-algorithm "
        "key-encoding key-size ca-file certificate-file privatekey-file fs-group renew-before "
        "reuse-private-key pkcs12-enable pkcs12-filename pkcs12-password"
    ).split()
)
GO_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")


@dataclass
class Identity:
    """What a daemon's certificate will hold, as requested from cert-manager."""

    source: str  # "csi volume tls" or "Certificate/NAME (Secret S)"
    uris: list[str]
    hosts: list[str]  # DNS names and IP addresses
    usages: list[str]
    issuer: tuple[str, str]  # (kind, name)
    problems: list[str] = field(default_factory=list)
    known: bool = True  # False: a Secret no Certificate keeps, so nothing else is known


def _csv(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def _expand(value: str, d: Daemon) -> str:
    """A csi attribute as the driver fills it in for one of the daemon's pods: ${POD_NAME}
    as the sample ``check_daemons`` gives the downward API's metadata.name."""
    names = {"POD_NAME": POD_NAME_SAMPLE, "POD_NAMESPACE": d.namespace}
    return re.sub(r"\$\{(\w+)\}", lambda m: names.get(m.group(1), f"sample-{m.group(1)}"), value)


def _csi_identity(d: Daemon, volume: dict[str, Any]) -> Identity:
    attrs = volume["csi"].get("volumeAttributes") or {}
    unknown = sorted(k for k in attrs if k.startswith(f"{CSI_DRIVER}/") and k not in CSI_ATTRIBUTES)
    identity = Identity(
        f"csi volume {volume['name']}",
        _csv(_expand(attrs.get(f"{CSI_DRIVER}/uri-sans", ""), d)),
        _csv(_expand(attrs.get(f"{CSI_DRIVER}/dns-names", ""), d))
        + _csv(attrs.get(f"{CSI_DRIVER}/ip-sans")),
        # the driver's default: digital signature, key encipherment (no server/client auth)
        _csv(attrs.get(f"{CSI_DRIVER}/key-usages", "digital signature,key encipherment")),
        (
            attrs.get(f"{CSI_DRIVER}/issuer-kind", "Issuer"),
            attrs.get(f"{CSI_DRIVER}/issuer-name", ""),
        ),
        [f"unknown attribute {k} (the driver refuses the volume)" for k in unknown],
    )
    duration = attrs.get(f"{CSI_DRIVER}/duration")
    if duration is not None and not GO_DURATION.match(duration):
        identity.problems.append(f"{CSI_DRIVER}/duration {duration!r} is not a duration (2160h)")
    return identity


def _certificate_identity(secret: str, d: Daemon, docs: list[dict[str, Any]]) -> Identity:
    certs = [
        c
        for c in by_kind(docs, "Certificate").values()
        if c.get("spec", {}).get("secretName") == secret
        and c["metadata"].get("namespace", "default") == d.namespace
    ]
    if not certs:
        return Identity(
            f"Secret {secret}",
            [],
            [],
            [],
            ("", ""),
            ["is kept by no Certificate: whose identity it holds is unknown"],
            known=False,
        )
    spec = certs[0]["spec"]
    ref = spec.get("issuerRef") or {}
    return Identity(
        f"Certificate/{certs[0]['metadata']['name']} (Secret {secret})",
        list(spec.get("uris") or []),
        list(spec.get("dnsNames") or []) + list(spec.get("ipAddresses") or []),
        # cert-manager's default when usages is empty: digital signature, key encipherment
        list(spec.get("usages") or ["digital signature", "key encipherment"]),
        (ref.get("kind", "Issuer"), ref.get("name", "")),
    )


def _dialled_hosts(d: Daemon, daemons: list[Daemon]) -> list[tuple[str, str]]:
    """(host, who dials it) for each address the daemon is reached at by the other daemons."""
    cfg = d.config
    if isinstance(cfg, WorkerConfig):
        if cfg.advertise_address:
            return [(cfg.advertise_address.rpartition(":")[0], "its advertise_address")]
        return [(cfg.advertise_host or "", "its advertise_host")]
    return [
        (w.config.coordinator.rpartition(":")[0], f"StatefulSet/{w.name}'s coordinator")
        for w in daemons
        if isinstance(w.config, WorkerConfig)
    ]


def _identity_problems(
    d: Daemon, identity: Identity, daemons: list[Daemon], docs: list[dict[str, Any]]
) -> list[str]:
    problems = list(identity.problems)
    if not identity.known:
        return [f"{identity.source}: {p}" for p in problems]
    cfg = d.config
    if isinstance(cfg, WorkerConfig):
        expected, why = WORKER_URI + str(cfg.name), "the name the worker registers"
    else:
        expected, why = COORDINATOR_URI, "the coordinator's identity"
    if identity.uris != [expected]:
        got = ", ".join(identity.uris) or "none"
        problems.append(
            f"its URI SANs are {got}, not exactly {expected} ({why}): peers take the daemon's "
            "identity from this URI".replace(POD_NAME_SAMPLE, "${POD_NAME}")
        )
    for host, who in _dialled_hosts(d, daemons):
        if host not in identity.hosts:
            problems.append(
                f"{host.replace(POD_NAME_SAMPLE, '$(POD_NAME)')} ({who}) is not among its DNS "
                "names and IPs: whoever dials it would refuse the certificate"
            )
    services = set(by_kind(docs, "Service"))
    for host in identity.hosts:
        labels = host.split(".")
        for i, label in enumerate(labels[:-1]):
            if label in services and labels[i + 1] not in ("svc", d.namespace):
                problems.append(
                    f"DNS name {host} names namespace {labels[i + 1]}, not {d.namespace}"
                )
    missing = [u for u in NEEDED_USAGES if u not in identity.usages]
    if missing:
        problems.append(
            f"usages lack {' and '.join(missing)}: each daemon serves its peers and dials them"
        )
    kind, name = identity.issuer
    if not name:
        problems.append("names no issuer")
    elif kind == "Issuer" and name not in {
        n
        for n, i in by_kind(docs, "Issuer").items()
        if i["metadata"].get("namespace", "default") == d.namespace
    }:
        problems.append(f"its issuer Issuer/{name} is not in the manifests")
    return [f"{identity.source}: {p}" for p in problems]


def identity_problems(daemons: list[Daemon], docs: list[dict[str, Any]]) -> list[str]:
    """Each daemon's certificate its own, naming it and the hosts it is dialled at."""
    problems: list[str] = []
    key_secrets: dict[str, str] = {}  # Secret -> the StatefulSet whose TLS key it holds
    for d in daemons:
        tls = d.config.tls
        if tls is None:
            continue  # check_daemons reports it
        cert, _, _ = volume_of(d, "tls.cert_file", tls.cert_file)
        key, _, _ = volume_of(d, "tls.key_file", tls.key_file)
        if cert is None or key is None:
            continue  # check_daemons reports where the files are
        found = []
        if cert["name"] != key["name"]:
            found.append(
                "tls.cert_file and tls.key_file are in different volumes: a certificate and "
                "its key come from one issuance"
            )
        if "csi" in key:
            found += _identity_problems(d, _csi_identity(d, key), daemons, docs)
        elif isinstance(d.config, WorkerConfig):
            found.append(
                f"tls.key_file is in Secret {key['secret']['secretName']}, which every pod of the "
                f"StatefulSet shares: a worker's certificate must be its own ({CSI_DRIVER} volume)"
            )
        else:
            secret = key["secret"]["secretName"]
            key_secrets[secret] = d.name
            found += _identity_problems(d, _certificate_identity(secret, d, docs), daemons, docs)
        problems += [f"StatefulSet/{d.name}: {p}" for p in found]
    for d in daemons:
        for volume in d.pod.get("volumes", []):
            owner = key_secrets.get(volume.get("secret", {}).get("secretName", ""))
            if owner is not None and owner != d.name:
                problems.append(
                    f"StatefulSet/{d.name}: mounts Secret {volume['secret']['secretName']}, "
                    f"which holds StatefulSet/{owner}'s TLS key: each pod has its own certificate"
                )
    return problems


def _certificate_problems(spec: dict[str, Any], issuers: set[str]) -> list[str]:
    problems = [f"unknown field spec.{k}" for k in sorted(set(spec) - CERTIFICATE_FIELDS)]
    if not isinstance(spec.get("secretName"), str) or not spec.get("secretName"):
        problems.append("spec.secretName is required (the Secret cert-manager keeps it in)")
    ref = spec.get("issuerRef")
    if not isinstance(ref, dict) or not isinstance(ref.get("name"), str):
        problems.append("spec.issuerRef.name is required")
    elif ref.get("kind", "Issuer") == "Issuer" and ref["name"] not in issuers:
        problems.append(f"spec.issuerRef names Issuer/{ref['name']}, not in the manifests")
    for key in LIST_FIELDS:
        value = spec.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            problems.append(f"spec.{key} must be a list of strings")
    problems += [
        f"spec.usages: unknown usage {u!r}" for u in spec.get("usages") or [] if u not in USAGES
    ]
    for key in ("duration", "renewBefore"):
        if key in spec and not GO_DURATION.match(str(spec[key])):
            problems.append(f"spec.{key} {spec[key]!r} is not a duration (2160h)")
    return problems


def _issuer_problems(spec: dict[str, Any]) -> list[str]:
    types = set(spec) & ISSUER_TYPES
    problems = [f"unknown field spec.{k}" for k in sorted(set(spec) - ISSUER_TYPES)]
    if len(types) != 1:
        problems.append(f"spec needs exactly one of {', '.join(sorted(ISSUER_TYPES))}")
    elif "ca" in types and not (spec["ca"] or {}).get("secretName"):
        problems.append(
            "spec.ca.secretName is required (the Secret with the CA's tls.crt, tls.key)"
        )
    return problems


def cert_manager_problems(docs: list[dict[str, Any]]) -> list[str]:
    """cert-manager's objects, checked minimally (kubernetes-validate has no schema for
    them): apiVersion, known and required spec fields, types, usages, durations."""
    problems = []
    for doc in docs:
        if doc.get("kind") not in CERT_MANAGER_KINDS:
            continue
        what = f"{doc['kind']}/{doc.get('metadata', {}).get('name')}"
        if doc.get("apiVersion") != API_VERSION:
            problems.append(f"{what}: apiVersion {doc.get('apiVersion')}, expected {API_VERSION}")
            continue
        spec = doc.get("spec")
        if not isinstance(spec, dict):
            problems.append(f"{what}: spec is required")
            continue
        namespace = doc["metadata"].get("namespace", "default")
        issuers = {
            n
            for n, i in by_kind(docs, "Issuer").items()
            if i["metadata"].get("namespace", "default") == namespace
        }
        found = (
            _certificate_problems(spec, issuers)
            if doc["kind"] == "Certificate"
            else _issuer_problems(spec)
        )
        problems += [f"{what}: {p}" for p in found]
    return problems
