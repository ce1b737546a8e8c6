"""Security material of a local cluster (``neuroshard up --secure``, ``demo --secure``).

Under ``DATA_DIR``: ``certs/`` (CA, node and client certificates: ``shared.certs``),
``auth/secret`` (the HS256 secret), ``auth/admin.token`` and ``auth/client.token`` (7 days),
and ``client.env`` (``NEUROSHARD_*`` variables for a shell: ``. DATA_DIR/client.env``).
Certificates and the secret of an earlier run are kept; tokens are signed anew each time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.certs import CertPaths, write_dev_certs
from shared.security import ChannelSecurity, client_security
from shared.tokens import create_token, read_secret, write_secret

TOKEN_TTL_S = 7 * 86400


@dataclass(frozen=True)
class SecureSetup:
    """Paths of a local cluster's certificates, secret and tokens."""

    root: Path
    certs: CertPaths
    secret_file: Path
    admin_token_file: Path
    client_token_file: Path

    @property
    def env_file(self) -> Path:
        return self.root / "client.env"

    def daemon_args(self) -> list[str]:
        """Flags of ``neuroshard coordinator`` and ``worker``: mutual TLS and token auth."""
        return [
            "--tls-ca",
            str(self.certs.ca_cert),
            "--tls-cert",
            str(self.certs.node_cert),
            "--tls-key",
            str(self.certs.node_key),
            "--auth-secret-file",
            str(self.secret_file),
        ]

    def client_security(self, admin: bool = False) -> ChannelSecurity:
        """The client certificate and the client (or admin) token."""
        return client_security(
            str(self.certs.ca_cert),
            str(self.certs.client_cert),
            str(self.certs.client_key),
            token_file=str(self.admin_token_file if admin else self.client_token_file),
        )

    def client_flags(self) -> str:
        """The flags a client command needs, for people to copy."""
        return (
            f"--tls-ca {self.certs.ca_cert} --tls-cert {self.certs.client_cert} "
            f"--tls-key {self.certs.client_key} --token-file {self.client_token_file}"
        )

    def write_env(self, address: str) -> Path:
        """Write ``client.env`` for ``address``; return its path."""
        lines = [
            f"NEUROSHARD_COORDINATOR={address}",
            f"NEUROSHARD_TLS_CA={self.certs.ca_cert}",
            f"NEUROSHARD_TLS_CERT={self.certs.client_cert}",
            f"NEUROSHARD_TLS_KEY={self.certs.client_key}",
            f"NEUROSHARD_TOKEN_FILE={self.client_token_file}",
        ]
        self.env_file.write_text("".join(f"export {line}\n" for line in lines))
        return self.env_file


def prepare(data_dir: str | Path) -> SecureSetup:
    """Create (or reuse) the certificates and secret under ``data_dir``, sign the tokens."""
    root = Path(data_dir)
    cert_dir, auth_dir = root / "certs", root / "auth"
    if (cert_dir / "node.key").exists():
        certs = CertPaths(
            *(
                cert_dir / n
                for n in ("ca.crt", "ca.key", "node.crt", "node.key", "client.crt", "client.key")
            )
        )
    else:
        certs = write_dev_certs(cert_dir)
    secret_file = auth_dir / "secret"
    if not secret_file.exists():
        write_secret(secret_file)
    secret = read_secret(secret_file)
    tokens = {}
    for role in ("admin", "client"):
        path = auth_dir / f"{role}.token"
        path.unlink(missing_ok=True)
        path.touch(mode=0o600)
        path.write_text(create_token(secret, role, f"local-{role}", TOKEN_TTL_S) + "\n")
        tokens[role] = path
    return SecureSetup(root, certs, secret_file, tokens["admin"], tokens["client"])
