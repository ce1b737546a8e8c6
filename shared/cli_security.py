"""Security on the command line: the ``--tls-*``/``--token`` flags of every client command,
the ``--tls-*``/``--auth-*`` flags of the daemons, and the ``certs`` and ``token`` commands.

Client flags fall back to environment variables (``NEUROSHARD_TLS_CA``, ``NEUROSHARD_TLS_CERT``,
``NEUROSHARD_TLS_KEY``, ``NEUROSHARD_TOKEN``, ``NEUROSHARD_TOKEN_FILE``), so that
``. DATA_DIR/client.env`` after ``neuroshard up --secure`` sets up a shell. Heavy modules
(grpc, cryptography) are imported only when a command needs them.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

ROLES = ("worker", "client", "admin")  # as shared.tokens.ROLES (not imported: no jwt here)
_ENV = {
    "tls_ca": "NEUROSHARD_TLS_CA",
    "tls_cert": "NEUROSHARD_TLS_CERT",
    "tls_key": "NEUROSHARD_TLS_KEY",
    "token": "NEUROSHARD_TOKEN",
    "token_file": "NEUROSHARD_TOKEN_FILE",
}


def add_tls_flags(parser: argparse.ArgumentParser, suppress: bool = False) -> None:
    """``--tls-ca``, ``--tls-cert``, ``--tls-key`` (all three or none)."""
    default = argparse.SUPPRESS if suppress else None
    parser.add_argument(
        "--tls-ca",
        default=default,
        metavar="PEM",
        help="CA certificate for mutual TLS (or $NEUROSHARD_TLS_CA)",
    )
    parser.add_argument(
        "--tls-cert",
        default=default,
        metavar="PEM",
        help="certificate presented (or $NEUROSHARD_TLS_CERT)",
    )
    parser.add_argument(
        "--tls-key",
        default=default,
        metavar="PEM",
        help="private key of --tls-cert (or $NEUROSHARD_TLS_KEY)",
    )


def add_client_flags(parser: argparse.ArgumentParser, suppress: bool = False) -> None:
    """TLS flags and ``--token``/``--token-file`` of a client command."""
    add_tls_flags(parser, suppress)
    default = argparse.SUPPRESS if suppress else None
    parser.add_argument("--token", default=default, help="bearer token (or $NEUROSHARD_TOKEN)")
    parser.add_argument(
        "--token-file",
        default=default,
        metavar="FILE",
        help="file holding the bearer token (or $NEUROSHARD_TOKEN_FILE)",
    )


def add_daemon_flags(parser: argparse.ArgumentParser) -> None:
    """TLS flags and ``--auth-secret-file``/``--auth-token-file`` of a daemon; they replace
    the config's ``tls`` and ``auth`` sections."""
    add_tls_flags(parser)
    parser.add_argument(
        "--auth-secret-file",
        metavar="FILE",
        help="require tokens signed with the secret in FILE (auth.secret_file)",
    )
    parser.add_argument(
        "--auth-token-file",
        metavar="FILE",
        help="token this daemon presents (auth.token_file; default: it signs "
        "a worker token itself)",
    )


def daemon_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Config overrides (``tls``, ``auth``) from a daemon's flags; empty when none given.

    Raises:
        ConfigError: only some of the TLS flags, or --auth-token-file without a secret.
    """
    from shared.config import ConfigError

    out: dict[str, Any] = {}
    files = [args.tls_ca, args.tls_cert, args.tls_key]
    if any(files):
        if not all(files):
            raise ConfigError("--tls-ca, --tls-cert and --tls-key: give all three or none")
        out["tls"] = {"ca_file": args.tls_ca, "cert_file": args.tls_cert, "key_file": args.tls_key}
    if args.auth_secret_file:
        out["auth"] = {"secret_file": args.auth_secret_file, "token_file": args.auth_token_file}
    elif args.auth_token_file:
        raise ConfigError("--auth-token-file: needs --auth-secret-file")
    return out


def client_security_of(args: argparse.Namespace) -> Any:
    """The ``ChannelSecurity`` of a client command from its flags and the environment.

    Raises:
        ConfigError: incomplete TLS flags, a missing or invalid file (names the flag).
    """
    from shared.security import client_security

    values = {k: getattr(args, k, None) or os.environ.get(env) or None for k, env in _ENV.items()}
    return client_security(**values)


def cmd_certs(args: argparse.Namespace) -> int:
    """``neuroshard certs DIR --hosts a,b``: a development CA and certificates."""
    from shared.certs import write_dev_certs

    hosts = [h for h in (args.hosts or "").split(",") if h.strip()]
    paths = write_dev_certs(args.dir, hosts)
    print(f"CA:     {paths.ca_cert} (key {paths.ca_key})")
    print(
        f"node:   {paths.node_cert} (key {paths.node_key}), hosts: "
        f"{', '.join([*hosts, 'localhost', '127.0.0.1'])}"
    )
    print(f"client: {paths.client_cert} (key {paths.client_key})")
    return 0


def cmd_token_create(args: argparse.Namespace) -> int:
    """``neuroshard token create --role R --ttl 1h --secret-file F [--subject S]``."""
    from shared.config import ConfigError
    from shared.tokens import SecretError, create_token, parse_ttl, read_secret

    try:
        ttl_s = parse_ttl(args.ttl)
        secret = read_secret(args.secret_file)
    except (ValueError, SecretError) as exc:
        raise ConfigError(str(exc).replace("secret_file", "--secret-file", 1)) from None
    subject = args.subject or f"{args.role}-{os.environ.get('USER', 'user')}"
    print(create_token(secret, args.role, subject, ttl_s))
    return 0


def cmd_token_secret(args: argparse.Namespace) -> int:
    """``neuroshard token secret FILE``: a new random HS256 secret (mode 0600)."""
    from shared.tokens import write_secret

    path = write_secret(args.file)
    print(
        f"wrote a new secret to {path} (mode 0600); give it to every daemon as auth.secret_file",
        file=sys.stderr,
    )
    return 0


def add_security_commands(sub: Any) -> None:
    """Add ``certs`` and ``token create|secret`` to the top-level subcommands."""
    c = sub.add_parser("certs", help="generate a development CA and mutual-TLS certificates")
    c.add_argument(
        "dir",
        metavar="DIR",
        help="directory to write ca.crt, node.crt, client.crt and their keys into",
    )
    c.add_argument(
        "--hosts",
        default="",
        metavar="NAME,...",
        help="host names and IPs of the node certificate (localhost and 127.0.0.1 "
        "are always added; wildcards like *.svc allowed)",
    )
    c.set_defaults(func=cmd_certs)

    t = sub.add_parser("token", help="create bearer tokens and token secrets")
    tsub = t.add_subparsers(dest="token_command", required=True, metavar="COMMAND")
    tc = tsub.add_parser("create", help="print a signed token")
    tc.add_argument("--role", required=True, choices=ROLES)  # shared.tokens.ROLES
    tc.add_argument("--ttl", default="1h", help="lifetime: 90s, 30m, 1h, 7d (default 1h)")
    tc.add_argument(
        "--secret-file", required=True, metavar="FILE", help="the daemons' auth.secret_file"
    )
    tc.add_argument("--subject", help="who the token is for (default ROLE-$USER)")
    tc.set_defaults(func=cmd_token_create)
    ts = tsub.add_parser("secret", help="write a new random secret to FILE (mode 0600)")
    ts.add_argument("file", metavar="FILE")
    ts.set_defaults(func=cmd_token_secret)
