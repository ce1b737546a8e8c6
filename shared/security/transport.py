"""Transport security of every connection: mutual TLS credentials and bearer tokens.

A daemon builds one ``DaemonSecurity`` from its config (``tls``, ``auth``): its server port
(TLS that requires client certificates signed by the CA, or plaintext), its server
interceptor (people's tokens, daemons' certificate identities), and the ``ChannelSecurity``
of every channel it opens (to the coordinator, to peer workers): TLS with its own
certificate, which names it (``shared.security.identity``), and no token: no bearer token
travels between daemons. Each dialer checks the peer's certificate against the host it
dials (gRPC's default; no name override). The client builds a ``ChannelSecurity`` from
``--tls-ca/--tls-cert/--tls-key`` and ``--token`` flags. Every channel goes through
``shared.rpc.channel``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes
from grpc import aio

from shared.channel_bytes import CountingChannel, WireBytes
from shared.config import AuthConfig, ConfigError, TlsConfig
from shared.delegating_channel import DelegatingChannel
from shared.security.identity import COORDINATOR, WORKER, identity_of_pem
from shared.security.tokens import (
    AUD_COORDINATOR,
    AUD_DATA,
    KeyFileError,
    Principal,
    RevocationList,
    TokenSource,
    mint_data_token,
    read_private_key,
    read_public_key,
)

Req = TypeVar("Req")
Resp = TypeVar("Resp")
TokenFn: TypeAlias = Callable[[], str]  # returns the token to present now

_TLS_HINT = (
    "the server may require TLS (pass --tls-ca, --tls-cert and --tls-key) or refuse "
    "this certificate"
)
_TLS_SIGNS = ("ssl", "handshake", "certificate", "socket closed", "connection reset", "tls")


@dataclass(frozen=True)
class TlsFiles:
    """PEM bytes of a CA certificate, a certificate and its private key, checked to match.

    Attributes:
        ca: the CA certificate(s) that sign every peer's certificate.
        cert: this process's certificate (leaf first).
        key: the unencrypted private key of ``cert``.
    """

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

        Args:
            ca_file: the CA certificate (PEM).
            cert_file: this process's certificate (PEM).
            key_file: its private key (PEM, unencrypted).
            names: the config keys or flags of the three files, named in errors.

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
        """Return server credentials: present the certificate, require a client one from the CA."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Return channel credentials: trust only the CA, present the certificate."""
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)


def _public_der(key: PublicKeyTypes) -> bytes:
    """The DER SubjectPublicKeyInfo of ``key``, to compare two keys of any kind."""
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _read(field_name: str, path: str) -> bytes:
    """The bytes of ``path``; ConfigError naming ``field_name`` when it cannot be read."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{field_name}: {path}: {exc.strerror or exc}") from None


# Invocation metadata as a call takes it: grpc.aio's Metadata or (key, value) pairs.
MetadataType: TypeAlias = aio.Metadata | Sequence[tuple[str, str | bytes]]


def _with_token(metadata: MetadataType | None, token: str) -> tuple[tuple[str, str | bytes], ...]:
    """The call's metadata plus ``authorization: Bearer <token>``."""
    auth = (("authorization", "Bearer " + token),)
    return tuple(metadata) + auth if metadata else auth


class _UnaryUnary(aio.UnaryUnaryMultiCallable[Req, Resp]):
    """A unary-unary multi-callable whose calls carry the bearer token."""

    def __init__(self, call: aio.UnaryUnaryMultiCallable[Req, Resp], token: TokenFn) -> None:
        self._call, self._token = call, token

    def __call__(
        self,
        request: Req,
        *,
        timeout: float | None = None,
        metadata: MetadataType | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> aio.UnaryUnaryCall[Req, Resp]:
        return self._call(
            request,
            timeout=timeout,
            metadata=_with_token(metadata, self._token()),
            credentials=credentials,
            wait_for_ready=wait_for_ready,
            compression=compression,
        )


class _UnaryStream(aio.UnaryStreamMultiCallable[Req, Resp]):
    """A unary-stream multi-callable whose calls carry the bearer token."""

    def __init__(self, call: aio.UnaryStreamMultiCallable[Req, Resp], token: TokenFn) -> None:
        self._call, self._token = call, token

    def __call__(
        self,
        request: Req,
        *,
        timeout: float | None = None,
        metadata: MetadataType | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> aio.UnaryStreamCall[Req, Resp]:
        return self._call(
            request,
            timeout=timeout,
            metadata=_with_token(metadata, self._token()),
            credentials=credentials,
            wait_for_ready=wait_for_ready,
            compression=compression,
        )


class _StreamUnary(aio.StreamUnaryMultiCallable[Req, Resp]):
    """A stream-unary multi-callable whose calls carry the bearer token."""

    def __init__(self, call: aio.StreamUnaryMultiCallable[Req, Resp], token: TokenFn) -> None:
        self._call, self._token = call, token

    def __call__(
        self,
        request_iterator: AsyncIterator[Req] | Iterator[Req] | None = None,
        timeout: float | None = None,
        metadata: MetadataType | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> aio.StreamUnaryCall[Req, Resp]:
        return self._call(
            request_iterator,
            timeout=timeout,
            metadata=_with_token(metadata, self._token()),
            credentials=credentials,
            wait_for_ready=wait_for_ready,
            compression=compression,
        )


class _StreamStream(aio.StreamStreamMultiCallable[Req, Resp]):
    """A stream-stream multi-callable whose calls carry the bearer token."""

    def __init__(self, call: aio.StreamStreamMultiCallable[Req, Resp], token: TokenFn) -> None:
        self._call, self._token = call, token

    def __call__(
        self,
        request_iterator: AsyncIterator[Req] | Iterator[Req] | None = None,
        timeout: float | None = None,
        metadata: MetadataType | None = None,
        credentials: grpc.CallCredentials | None = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> aio.StreamStreamCall[Req, Resp]:
        return self._call(
            request_iterator,
            timeout=timeout,
            metadata=_with_token(metadata, self._token()),
            credentials=credentials,
            wait_for_ready=wait_for_ready,
            compression=compression,
        )


class TokenChannel(DelegatingChannel):
    """A grpc.aio channel whose every call carries the bearer token.

    Stubs get their multi-callables from ``unary_unary`` and friends; wrapping those costs a
    function call per RPC, where grpc.aio client interceptors cost ~200 us of CPU (an extra
    task per call). Everything else is delegated to the wrapped channel.
    """

    def __init__(self, channel: aio.Channel, token: TokenFn) -> None:
        """Wrap ``channel``; ``token()`` is asked for the token at every call (it may renew)."""
        super().__init__(channel)
        self._token = token

    def unary_unary(
        self,
        method: str,
        request_serializer: Callable[[Req], bytes] | None = None,
        response_deserializer: Callable[[bytes], Resp] | None = None,
        **kwargs: Any,
    ) -> aio.UnaryUnaryMultiCallable[Req, Resp]:
        """Return the channel's multi-callable for ``method``, adding the token to calls.

        ``kwargs`` (the generated stubs' ``_registered_method``) are passed on.
        """
        call = self._channel.unary_unary(
            method, request_serializer, response_deserializer, **kwargs
        )
        return _UnaryUnary(call, self._token)

    def unary_stream(
        self,
        method: str,
        request_serializer: Callable[[Req], bytes] | None = None,
        response_deserializer: Callable[[bytes], Resp] | None = None,
        **kwargs: Any,
    ) -> aio.UnaryStreamMultiCallable[Req, Resp]:
        """Return the channel's multi-callable for ``method``, adding the token to calls."""
        call = self._channel.unary_stream(
            method, request_serializer, response_deserializer, **kwargs
        )
        return _UnaryStream(call, self._token)

    def stream_unary(
        self,
        method: str,
        request_serializer: Callable[[Req], bytes] | None = None,
        response_deserializer: Callable[[bytes], Resp] | None = None,
        **kwargs: Any,
    ) -> aio.StreamUnaryMultiCallable[Req, Resp]:
        """Return the channel's multi-callable for ``method``, adding the token to calls."""
        call = self._channel.stream_unary(
            method, request_serializer, response_deserializer, **kwargs
        )
        return _StreamUnary(call, self._token)

    def stream_stream(
        self,
        method: str,
        request_serializer: Callable[[Req], bytes] | None = None,
        response_deserializer: Callable[[bytes], Resp] | None = None,
        **kwargs: Any,
    ) -> aio.StreamStreamMultiCallable[Req, Resp]:
        """Return the channel's multi-callable for ``method``, adding the token to calls."""
        call = self._channel.stream_stream(
            method, request_serializer, response_deserializer, **kwargs
        )
        return _StreamStream(call, self._token)


@dataclass(frozen=True)
class ChannelSecurity:
    """How a process dials: with or without TLS, with or without a token.

    Attributes:
        tls: the CA and this process's certificate and key; None dials in plaintext.
        token: the token presented on every call; None presents none.
        server_name: the name expected in server certificates; None expects the host dialed.
        wire: where a daemon counts the bytes of its own calls (its ``Metrics``): every
            channel opened is then a ``CountingChannel``; None counts nothing (clients).
    """

    tls: TlsFiles | None = None
    token: TokenFn | None = None
    server_name: str | None = None
    _creds: list[grpc.ChannelCredentials] = field(default_factory=list, repr=False, compare=False)
    wire: WireBytes | None = field(default=None, repr=False, compare=False)

    def open(self, address: str, options: Sequence[tuple[str, int | str]]) -> aio.Channel:
        """Open a grpc.aio channel to ``address`` with this security and ``options``.

        Every channel of the process shares one credentials object, so the TLS files are
        parsed once. With a token, the channel is a ``TokenChannel``.
        """
        if self.tls is None:
            ch = aio.insecure_channel(address, options=options)
        else:
            if not self._creds:  # one credentials object for every channel of the process
                self._creds.append(self.tls.channel_credentials())
            if self.server_name:
                options = [*options, ("grpc.ssl_target_name_override", self.server_name)]
            ch = aio.secure_channel(address, self._creds[0], options=options)
        if self.wire is not None:
            ch = CountingChannel(ch, self.wire)
        if self.token is None:
            return ch
        return TokenChannel(ch, self.token)


PLAINTEXT = ChannelSecurity()


def explain_unavailable(details: str, security: ChannelSecurity | None) -> str:
    """Add a hint to an UNAVAILABLE error's details when they look like a TLS mismatch.

    A plaintext client of a TLS server (or the reverse) sees a closed socket or a handshake
    error, which says nothing about TLS to most people.

    Args:
        details: the error's details.
        security: how the client dialed; None is plaintext.

    Returns:
        ``details``, followed by a hint in parentheses when it mentions ssl, handshakes,
        certificates or a reset connection.
    """
    text = details or "unavailable"
    if any(sign in text.lower() for sign in _TLS_SIGNS):
        if security is None or security.tls is None:
            return f"{text} ({_TLS_HINT})"
        return f"{text} (TLS handshake failed: check that both sides use the same CA)"
    return text


def _signing_key(auth: AuthConfig, public_key: Ed25519PublicKey) -> Ed25519PrivateKey:
    """The coordinator's token-signing key, checked to belong to the public key.

    Raises:
        ConfigError: no private key given, or not the public key's.
        KeyFileError: the key file cannot be read.
    """
    if not auth.private_key_file:
        raise ConfigError(
            "auth.private_key_file: required on the coordinator, which mints the clients' "
            "data-plane tokens"
        )
    key = read_private_key(auth.private_key_file, "auth.private_key_file")
    if _public_der(key.public_key()) != _public_der(public_key):
        raise ConfigError(
            f"auth.private_key_file: {auth.private_key_file} is not the private key of "
            f"auth.public_key_file {auth.public_key_file}"
        )
    return key


def _check_identity(files: TlsFiles, cert_file: str, kind: str, name: str) -> None:
    """Check that this daemon's certificate names it (``spiffe://neuroshard/...``).

    Raises:
        ConfigError: the certificate names no daemon or another one (names the field).
    """
    identity = identity_of_pem(files.cert)
    expected = "the coordinator" if kind == COORDINATOR else f"worker {name!r}"
    if identity is None or identity.kind != kind or (kind == WORKER and identity.name != name):
        found = "no daemon" if identity is None else f"{identity.kind} {identity.name!r}"
        raise ConfigError(
            f"tls.cert_file: {cert_file} names {found}, not {expected} (a daemon certificate "
            "carries the URI spiffe://neuroshard/coordinator or spiffe://neuroshard/worker/NAME; "
            "neuroshard certs DIR --workers NAME makes them)"
        )


@dataclass
class DaemonSecurity:
    """A daemon's security, from its ``tls`` and ``auth`` config sections.

    Attributes:
        tls: the daemon's TLS files; None serves and dials in plaintext.
        public_key: verifies the tokens of callers; None accepts calls without tokens.
        channel: how the daemon dials the others (its certificate, no token).
        signing_key: the coordinator's token-signing key (data-plane tokens); None on
            workers and without auth.
        revoked: the revocation list of ``auth.revoked_file``.
        audience: the token audience this daemon accepts.
    """

    tls: TlsFiles | None
    public_key: Ed25519PublicKey | None
    channel: ChannelSecurity
    signing_key: Ed25519PrivateKey | None = None
    revoked: RevocationList = field(default_factory=lambda: RevocationList(None))
    audience: str = AUD_COORDINATOR

    @classmethod
    def from_config(
        cls,
        tls: TlsConfig | None,
        auth: AuthConfig | None,
        subject: str,
        *,
        coordinator: bool = False,
    ) -> DaemonSecurity:
        """Load and check a daemon's TLS files and token keys.

        With auth on, TLS is required and the daemon's certificate must name it: the
        coordinator's ``spiffe://neuroshard/coordinator``, a worker's
        ``spiffe://neuroshard/worker/NAME`` for its own name. The coordinator needs the
        private key (it mints data-plane tokens); a worker must not have it.

        Args:
            tls: the ``tls`` section; None serves and dials in plaintext.
            auth: the ``auth`` section; None requires no token and no daemon identity.
            subject: the worker's name (unused on the coordinator).
            coordinator: whether this is the coordinator.

        Raises:
            ConfigError: a file is missing or invalid, auth without tls, a certificate
                that names another daemon, a worker holding the private key, a coordinator
                without it (names the field).
        """
        files = None if tls is None else TlsFiles.load(tls.ca_file, tls.cert_file, tls.key_file)
        public_key, signing_key = None, None
        revoked = RevocationList(None)
        if auth is not None:
            if files is None or tls is None:
                raise ConfigError(
                    "auth: needs tls: daemons authenticate each other by their certificates, "
                    "and tokens must not travel in plaintext"
                )
            kind = COORDINATOR if coordinator else WORKER
            _check_identity(files, tls.cert_file, kind, subject)
            try:
                public_key = read_public_key(auth.public_key_file, "auth.public_key_file")
                if coordinator:
                    signing_key = _signing_key(auth, public_key)
                elif auth.private_key_file:
                    raise ConfigError(
                        "auth.private_key_file: a worker must not hold the private key (it "
                        "could mint any token); workers need only auth.public_key_file"
                    )
            except KeyFileError as exc:
                raise ConfigError(str(exc)) from None
            revoked = RevocationList(auth.revoked_file)
        audience = AUD_COORDINATOR if coordinator else AUD_DATA
        return cls(files, public_key, ChannelSecurity(files), signing_key, revoked, audience)

    @property
    def transport(self) -> str:
        """``mtls`` or ``plaintext`` (logged at start)."""
        return "plaintext" if self.tls is None else "mtls"

    @property
    def auth(self) -> str:
        """``token`` or ``none`` (logged at start)."""
        return "none" if self.public_key is None else "token"

    def data_token_minter(self, ttl_s: float) -> Callable[[Principal], tuple[str, float]] | None:
        """Mint data-plane tokens of ``ttl_s`` seconds for callers (None without the key).

        Returns:
            ``mint(principal) -> (token, expires_at)``; it raises DataTokenRefused for a
            daemon or an expiring caller (``tokens.mint_data_token``).
        """
        key = self.signing_key
        if key is None:
            return None
        return lambda principal: mint_data_token(key, principal, ttl_s)

    def add_port(self, server: aio.Server, listen: str) -> int:
        """Bind ``listen`` on ``server`` with mutual TLS, or in plaintext without TLS files.

        Args:
            server: the daemon's server, not started yet.
            listen: ``host:port``; port 0 picks a free one.

        Returns:
            The port bound (0 when binding failed, as grpc reports it).
        """
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
    """Build a client's ``ChannelSecurity`` from its command-line flags.

    Args:
        tls_ca: the CA certificate that signs the servers' (PEM file).
        tls_cert: the client certificate (PEM file); all three TLS files or none.
        tls_key: the client certificate's key (PEM file).
        token: a bearer token; preferred over ``token_file``.
        token_file: a file holding the bearer token.
        server_name: the name expected in server certificates instead of the host dialed.

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
