"""Security material of a local cluster (``neuroshard up --secure``, ``demo --secure``).

Under ``DATA_DIR``: ``certs/`` (the CA, the coordinator's and the client certificate, and
``certs/workers/NAME.crt`` for each worker, made when the worker starts:
``shared.security.certs``), ``auth/private.pem`` and ``auth/public.pem`` (the Ed25519 token key
pair), ``auth/admin.token`` and ``auth/writer.token`` (for people, 7 days), and ``client.env``
(``NEUROSHARD_*`` variables for a shell, with the writer token: ``. DATA_DIR/client.env``).
Daemons carry no token: each is known by its own certificate. Certificates and the key pair of
an earlier run are kept; people's tokens are signed anew each time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from shared.security.certs import CertPaths, issue_worker, write_dev_certs
from shared.security.tokens import (
    PRIVATE_KEY_NAME,
    PUBLIC_KEY_NAME,
    create_token,
    read_private_key,
    write_keypair,
)
from shared.security.transport import ChannelSecurity, client_security

TOKEN_TTL_S = 7 * 86400


def _write_token(path: Path, token: str) -> Path:
    """Write ``token`` to ``path`` with mode 0600 (replacing an older one); return the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    path.touch(mode=0o600)
    path.write_text(token + "\n")
    return path


@dataclass(frozen=True)
class SecureSetup:
    """Paths of a local cluster's certificates, token keys and tokens, and the flags using them.

    Attributes:
        root: the cluster's data dir.
        certs: the CA, node and client certificates.
        private_key_file: the token-signing key (the coordinator's only).
        public_key_file: the token-verifying key (every daemon's).
        admin_token_file: an ``admin`` token for ``local-admin``, 7 days.
        writer_token_file: a ``writer`` token for ``local-writer``, 7 days.
    """

    root: Path
    certs: CertPaths
    private_key_file: Path
    public_key_file: Path
    admin_token_file: Path
    writer_token_file: Path

    @property
    def env_file(self) -> Path:
        """``ROOT/client.env``, the shell settings ``write_env`` writes."""
        return self.root / "client.env"

    def _tls_args(self, cert: Path, key: Path) -> list[str]:
        """The ``--tls-*`` flags of a daemon: the CA and the daemon's own certificate."""
        return ["--tls-ca", str(self.certs.ca_cert), "--tls-cert", str(cert), "--tls-key", str(key)]

    def coordinator_args(self) -> list[str]:
        """Return the flags of ``neuroshard coordinator`` for this cluster.

        Mutual TLS with the coordinator's certificate; tokens verified with the public key;
        the private key, with which the coordinator mints data-plane tokens.
        """
        return [
            *self._tls_args(self.certs.coordinator_cert, self.certs.coordinator_key),
            "--auth-public-key-file",
            str(self.public_key_file),
            "--auth-private-key-file",
            str(self.private_key_file),
        ]

    def worker_args(self, name: str) -> list[str]:
        """Issue worker ``name``'s certificate (if it has none) and return its flags.

        Mutual TLS with the worker's own certificate (identity
        ``spiffe://neuroshard/worker/NAME``) and the public key; the worker holds no token
        and never sees the private key.

        Raises:
            ValueError: ``name`` is not a valid worker name.
        """
        cert, key = self.certs.worker(name)
        if not (cert.exists() and key.exists()):
            cert, key = issue_worker(self.certs, name)
        return [
            *self._tls_args(cert, key),
            "--auth-public-key-file",
            str(self.public_key_file),
        ]

    def client_security(self, admin: bool = False) -> ChannelSecurity:
        """Return a client's security: the client certificate and the writer or admin token."""
        return client_security(
            str(self.certs.ca_cert),
            str(self.certs.client_cert),
            str(self.certs.client_key),
            token_file=str(self.admin_token_file if admin else self.writer_token_file),
        )

    def client_flags(self) -> str:
        """Return the flags a client command needs (writer token), for people to copy."""
        return (
            f"--tls-ca {self.certs.ca_cert} --tls-cert {self.certs.client_cert} "
            f"--tls-key {self.certs.client_key} --token-file {self.writer_token_file}"
        )

    def write_env(self, address: str) -> Path:
        """Write ``client.env``, the ``NEUROSHARD_*`` settings of a shell, and return its path.

        Args:
            address: the coordinator's ``host:port``.
        """
        lines = [
            f"NEUROSHARD_COORDINATOR={address}",
            f"NEUROSHARD_TLS_CA={self.certs.ca_cert}",
            f"NEUROSHARD_TLS_CERT={self.certs.client_cert}",
            f"NEUROSHARD_TLS_KEY={self.certs.client_key}",
            f"NEUROSHARD_TOKEN_FILE={self.writer_token_file}",
        ]
        self.env_file.write_text("".join(f"export {line}\n" for line in lines))
        return self.env_file


def prepare(data_dir: str | Path) -> SecureSetup:
    """Create or reuse a local cluster's certificates and token key pair; sign people's tokens.

    Certificates and the key pair of an earlier run under ``data_dir`` are kept (tokens
    signed with them stay valid); the admin and writer tokens (subjects ``local-admin``,
    ``local-writer``, 7 days) are signed anew.

    Raises:
        OSError: ``data_dir`` cannot be written.
        KeyFileError: an existing private key cannot be read.
    """
    root = Path(data_dir)
    cert_dir, auth_dir = root / "certs", root / "auth"
    certs = CertPaths.under(cert_dir)
    if not certs.coordinator_key.exists():
        certs = write_dev_certs(cert_dir)
    private_file, public_file = auth_dir / PRIVATE_KEY_NAME, auth_dir / PUBLIC_KEY_NAME
    if not (private_file.exists() and public_file.exists()):
        private_file.unlink(missing_ok=True)
        write_keypair(auth_dir)
    key = read_private_key(private_file)
    tokens = {
        role: _write_token(
            auth_dir / f"{role}.token", create_token(key, role, f"local-{role}", TOKEN_TTL_S)
        )
        for role in ("admin", "writer")
    }
    return SecureSetup(root, certs, private_file, public_file, tokens["admin"], tokens["writer"])
