"""Transport security of every connection: mutual TLS credentials and bearer tokens.

A daemon builds one ``DaemonSecurity`` from its config (``tls``, ``auth``): its server port
(TLS that requires client certificates signed by the CA, or plaintext), its server
interceptor (token check), and the ``ChannelSecurity`` of every channel it opens (to the
coordinator, to peer workers: TLS with its own certificate, and its token: the coordinator's
``admin`` token signed with its private key, a worker's ``worker`` token from a file). The client
builds a ``ChannelSecurity`` from ``--tls-ca/--tls-cert/--tls-key`` and ``--token`` flags.
Every channel goes through ``shared.rpc.channel``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from grpc import aio

from shared.config import AuthConfig, ConfigError, TlsConfig
from shared.security.tokens import (
    KeyFileError,
    TokenError,
    TokenSource,
    read_private_key,
    read_public_key,
    verify_token,
)

_TLS_HINT = (
    "the server may require TLS (pass --tls-ca, --tls-cert and --tls-key) or refuse "
    "this certificate"
)
_TLS_SIGNS = ("ssl", "handshake", "certificate", "socket closed", "connection reset", "tls")


@dataclass(frozen=True)
class TlsFiles:
    """PEM bytes of a CA certificate, a certificate and its private key."""

    ca: bytes
    cert: bytes
    key: bytes

    @classmethod
    def load(
        cls,
        ca_file: str,
        cert_file: str,
        key_file: str,
        names: tuple[str, str, str] = ("tls.ca_file", "tls.cert_file", "tls.key_file"),
    ) -> TlsFiles:
        """Read and check the three files (the key must belong to the certificate).

        Raises:
            ConfigError: a file is missing or not PEM of the right kind (names the field).
        """
        ca_name, cert_name, key_name = names
        ca, cert = _read(ca_name, ca_file), _read(cert_name, cert_file)
        key = _read(key_name, key_file)
        try:
            x509.load_pem_x509_certificates(ca)
        except ValueError:
            raise ConfigError(f"{ca_name}: {ca_file} is not a PEM certificate") from None
        try:
            leaf = x509.load_pem_x509_certificates(cert)[0]
        except ValueError:
            raise ConfigError(f"{cert_name}: {cert_file} is not a PEM certificate") from None
        try:
            private = serialization.load_pem_private_key(key, password=None)
        except (ValueError, TypeError):
            raise ConfigError(
                f"{key_name}: {key_file} is not an unencrypted PEM private key"
            ) from None
        if _public_der(private.public_key()) != _public_der(leaf.public_key()):
            raise ConfigError(f"{key_name}: {key_file} is not the key of {cert_file}")
        return cls(ca, cert, key)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server side: present the certificate, require a client certificate from the CA."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client side: trust only the CA, present the certificate."""
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)


def _public_der(key: Any) -> bytes:
    return key.public_bytes(
        serialization.Encoding.DER,  # type: ignore[no-any-return]
        serialization.PublicFormat.SubjectPublicKeyInfo,
    )


def _read(field_name: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{field_name}: {path}: {exc.strerror or exc}") from None


class _WithToken:
    """A multi-callable of a channel that adds ``authorization: Bearer <token>`` metadata."""

    __slots__ = ("_call", "_token")

    def __init__(self, call: Any, token: Callable[[], str]) -> None:
        self._call, self._token = call, token

    def __call__(self, *args: Any, metadata: Any = None, **kwargs: Any) -> Any:
        auth = (("authorization", "Bearer " + self._token()),)
        return self._call(*args, metadata=tuple(metadata) + auth if metadata else auth, **kwargs)


class TokenChannel:
    """A grpc.aio channel whose every call carries the bearer token.

    Stubs get their multi-callables from ``unary_unary`` and friends; wrapping those costs a
    function call per RPC, where grpc.aio client interceptors cost ~200 us of CPU (an extra
    task per call). Everything else is the wrapped channel's.
    """

    def __init__(self, channel: aio.Channel, token: Callable[[], str]) -> None:
        self._channel, self._token = channel, token

    def unary_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _WithToken(self._channel.unary_unary(*args, **kwargs), self._token)

    def unary_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _WithToken(self._channel.unary_stream(*args, **kwargs), self._token)

    def stream_unary(self, *args: Any, **kwargs: Any) -> Any:
        return _WithToken(self._channel.stream_unary(*args, **kwargs), self._token)

    def stream_stream(self, *args: Any, **kwargs: Any) -> Any:
        return _WithToken(self._channel.stream_stream(*args, **kwargs), self._token)

    async def __aenter__(self) -> TokenChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._channel.close()

    def __getattr__(self, name: str) -> Any:  # close, channel_ready, get_state, ...
        return getattr(self._channel, name)


@dataclass(frozen=True)
class ChannelSecurity:
    """How a process dials: TLS files (None: plaintext), the token it presents (None: none),
    and the name expected in server certificates (None: the host dialed)."""

    tls: TlsFiles | None = None
    token: TokenSource | None = None
    server_name: str | None = None
    _creds: list[grpc.ChannelCredentials] = field(default_factory=list, repr=False, compare=False)

    def open(self, address: str, options: list[tuple[str, Any]]) -> aio.Channel:
        """A grpc.aio channel to ``address`` with this security and ``options``."""
        if self.tls is None:
            ch = aio.insecure_channel(address, options=options)
        else:
            if not self._creds:  # one credentials object for every channel of the process
                self._creds.append(self.tls.channel_credentials())
            if self.server_name:
                options = [*options, ("grpc.ssl_target_name_override", self.server_name)]
            ch = aio.secure_channel(address, self._creds[0], options=options)
        if self.token is None:
            return ch
        return TokenChannel(ch, self.token)  # type: ignore[return-value]


PLAINTEXT = ChannelSecurity()


def explain_unavailable(details: str, security: ChannelSecurity | None) -> str:
    """Add a hint to an UNAVAILABLE error that looks like a TLS mismatch."""
    text = details or "unavailable"
    if any(sign in text.lower() for sign in _TLS_SIGNS):
        if security is None or security.tls is None:
            return f"{text} ({_TLS_HINT})"
        return f"{text} (TLS handshake failed: check that both sides use the same CA)"
    return text


def _coordinator_token(auth: AuthConfig, public_key: Ed25519PublicKey, subject: str) -> TokenSource:
    """The coordinator's own token source. Raises: ConfigError, KeyFileError."""
    if auth.private_key_file:
        key = read_private_key(auth.private_key_file, "auth.private_key_file")
        if _public_der(key.public_key()) != _public_der(public_key):
            raise ConfigError(
                f"auth.private_key_file: {auth.private_key_file} is not the private key of "
                f"auth.public_key_file {auth.public_key_file}"
            )
        return TokenSource(private_key=key, role="admin", subject=subject)
    if auth.token_file:
        return TokenSource.from_file(auth.token_file, "auth.token_file")
    raise ConfigError(
        "auth.private_key_file: required on the coordinator, which signs its own token "
        "(or give auth.token_file)"
    )


def _worker_token(auth: AuthConfig, public_key: Ed25519PublicKey, name: str) -> TokenSource:
    """A worker's token source, checked now rather than refused at registration.

    Raises: ConfigError, KeyFileError.
    """
    if auth.private_key_file:
        raise ConfigError(
            "auth.private_key_file: a worker must not hold the private key (it could mint "
            "any token); give it auth.token_file, a worker token"
        )
    if not auth.token_file:
        raise ConfigError(
            "auth.token_file: required on a worker (neuroshard token create --role worker "
            f"--subject {name or 'NAME'} ...)"
        )
    source = TokenSource.from_file(auth.token_file, "auth.token_file")
    try:
        principal = verify_token(public_key, source())
    except TokenError as exc:
        raise ConfigError(f"auth.token_file: {auth.token_file}: {exc}") from None
    if principal.role != "worker" or not principal.may_act_as(name):
        raise ConfigError(
            f"auth.token_file: {auth.token_file} is a {principal.role} token for "
            f"{principal.describe()}; worker {name!r} needs a worker token for its name"
        )
    return source


@dataclass
class DaemonSecurity:
    """A daemon's security, from its ``tls`` and ``auth`` config sections."""

    tls: TlsFiles | None
    public_key: Ed25519PublicKey | None
    channel: ChannelSecurity

    @classmethod
    def from_config(
        cls,
        tls: TlsConfig | None,
        auth: AuthConfig | None,
        subject: str,
        *,
        coordinator: bool = False,
    ) -> DaemonSecurity:
        """Load the files. The coordinator's own token is an ``admin`` token for ``subject``
        it signs with ``auth.private_key_file`` (1 h, renewed at half-life), or the one in
        ``auth.token_file``; a worker presents ``auth.token_file``, which must be a valid
        ``worker`` token covering its name ``subject``.

        Raises:
            ConfigError: a file is missing or invalid, a worker has no token_file or holds the
                private key, or a worker's token is not for it (names the field).
        """
        files = None if tls is None else TlsFiles.load(tls.ca_file, tls.cert_file, tls.key_file)
        public_key, token = None, None
        if auth is not None:
            try:
                public_key = read_public_key(auth.public_key_file, "auth.public_key_file")
                token = (
                    _coordinator_token(auth, public_key, subject)
                    if coordinator
                    else _worker_token(auth, public_key, subject)
                )
            except KeyFileError as exc:
                raise ConfigError(str(exc)) from None
        server_name = tls.server_name if tls is not None else None
        return cls(files, public_key, ChannelSecurity(files, token, server_name))

    @property
    def transport(self) -> str:
        """``mtls`` or ``plaintext`` (logged at start)."""
        return "plaintext" if self.tls is None else "mtls"

    @property
    def auth(self) -> str:
        """``token`` or ``none`` (logged at start)."""
        return "none" if self.public_key is None else "token"

    def add_port(self, server: aio.Server, listen: str) -> int:
        """Bind ``listen`` (TLS or plaintext); return the port bound."""
        if self.tls is None:
            return server.add_insecure_port(listen)
        return server.add_secure_port(listen, self.tls.server_credentials())


def client_security(
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    token: str | None = None,
    token_file: str | None = None,
    server_name: str | None = None,
) -> ChannelSecurity:
    """A client's ``ChannelSecurity`` from its flags (all three TLS files or none).

    Raises:
        ConfigError: only some TLS files given, a file missing or invalid, an empty token.
    """
    files = None
    if tls_ca and tls_cert and tls_key:
        files = TlsFiles.load(tls_ca, tls_cert, tls_key, ("--tls-ca", "--tls-cert", "--tls-key"))
    elif tls_ca or tls_cert or tls_key:
        raise ConfigError("--tls-ca, --tls-cert and --tls-key: give all three or none")
    source = None
    if token:
        source = TokenSource(token)
    elif token_file:
        try:
            source = TokenSource.from_file(token_file, "--token-file")
        except KeyFileError as exc:
            raise ConfigError(str(exc)) from None
    return ChannelSecurity(files, source, server_name)
