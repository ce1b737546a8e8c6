"""Certificates, a token key pair and tokens for the security tests, and state snapshots that
show a refused request changed nothing."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from shared.config import AuthConfig, TlsConfig
from shared.security.certs import CertPaths, issue_worker, write_dev_certs
from shared.security.tokens import AUD_COORDINATOR, create_token, read_private_key, write_keypair
from shared.security.transport import ChannelSecurity, client_security


@dataclass
class Material:
    """Certificates and an Ed25519 token key pair generated for one test."""

    root: Path
    certs: CertPaths
    private_key_file: Path
    public_key_file: Path

    @classmethod
    def make(cls, root: Path) -> Material:
        private, public = write_keypair(root / "auth")
        return cls(root, write_dev_certs(root / "certs"), private, public)

    @property
    def key(self) -> Ed25519PrivateKey:
        return read_private_key(self.private_key_file)

    @property
    def tls(self) -> TlsConfig:
        """The coordinator's TLS (its certificate names it)."""
        return TlsConfig(
            ca_file=str(self.certs.ca_cert),
            cert_file=str(self.certs.coordinator_cert),
            key_file=str(self.certs.coordinator_key),
        )

    def worker_cert(self, name: str, hosts: tuple[str, ...] = ()) -> tuple[Path, Path]:
        """Worker ``name``'s certificate and key, issued on first use."""
        cert, key = self.certs.worker(name)
        if not cert.exists():
            cert, key = issue_worker(self.certs, name, hosts)
        return cert, key

    def worker_tls(self, name: str) -> TlsConfig:
        """Worker ``name``'s TLS (its own certificate, identity spiffe://neuroshard/worker/NAME)."""
        cert, key = self.worker_cert(name)
        return TlsConfig(ca_file=str(self.certs.ca_cert), cert_file=str(cert), key_file=str(key))

    def daemon_client(self, name: str | None = None) -> ChannelSecurity:
        """Dial as a daemon without a token: worker ``name``'s certificate, or the coordinator's."""
        if name is None:
            cert, key = self.certs.coordinator_cert, self.certs.coordinator_key
        else:
            cert, key = self.worker_cert(name)
        return client_security(str(self.certs.ca_cert), str(cert), str(key))

    @property
    def coordinator_auth(self) -> AuthConfig:
        return AuthConfig(
            public_key_file=str(self.public_key_file),
            private_key_file=str(self.private_key_file),
        )

    @property
    def worker_auth(self) -> AuthConfig:
        """A worker's auth: the public key only (it is known by its certificate)."""
        return AuthConfig(public_key_file=str(self.public_key_file))

    def token(
        self,
        role: str,
        subject: str = "tester",
        ttl_s: float = 300,
        now: float | None = None,
        audience: str = AUD_COORDINATOR,
    ) -> str:
        return create_token(self.key, role, subject, ttl_s, now=now, audience=audience)

    def client(self, token: str | None) -> ChannelSecurity:
        c = self.certs
        return client_security(str(c.ca_cert), str(c.client_cert), str(c.client_key), token=token)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def forged_tokens(material: Material) -> dict[str, str]:
    """Tokens that claim the admin role but must be refused, by what is wrong with them."""
    now = int(time.time())
    claims = {"sub": "mallory", "role": "admin", "iss": "neuroshard", "iat": now, "exp": now + 300}
    # HS256 keyed with the public key's PEM: the algorithm-confusion attack (built by hand,
    # PyJWT refuses a PEM key as an HMAC secret).
    head = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    body = _b64(json.dumps(claims).encode())
    mac = hmac.new(material.public_key_file.read_bytes(), f"{head}.{body}".encode(), "sha256")
    return {
        "alg none": jwt.encode(claims, None, algorithm="none"),
        "hs256": jwt.encode(claims, hashlib.sha256(b"guess").hexdigest(), algorithm="HS256"),
        "hs256 keyed with the public key": f"{head}.{body}.{_b64(mac.digest())}",
        "expired": material.token("admin", "old", ttl_s=10, now=time.time() - 600),
        "another key": create_token(Ed25519PrivateKey.generate(), "admin", "mallory", 300),
    }


FORGED_MESSAGES = {
    "alg none": "token is signed with alg 'none'; only EdDSA (Ed25519) tokens are accepted",
    "hs256": "token is signed with alg 'HS256'; only EdDSA (Ed25519) tokens are accepted",
    "hs256 keyed with the public key": "token is signed with alg 'HS256'",
    "expired": "token expired at ",
    "another key": "token signature is invalid",
}


def coordinator_state(cluster: Any) -> dict[str, Any]:
    """What a refused request must not change on the coordinator: jobs, members, slot map."""
    c = cluster.coordinator.cluster
    return {
        "jobs": [(j.job_id, j.state.value, j.owner) for j in c.jobs.list()],
        "workers": [(w.name, w.address, w.state.value, w.memories) for w in c.membership.all()],
        "epoch": c.rebalancer.current.epoch,
    }


def worker_state(worker: Any) -> tuple[int, list[int], list[float]]:
    """A worker's slot-map epoch and its store's ``{id: strength}`` as sorted lists."""
    node = worker.nodes.current
    if node is None:
        return 0, [], []
    ids, strengths = node.items()
    order = ids.argsort()
    return node.epoch, ids[order].tolist(), strengths[order].tolist()
