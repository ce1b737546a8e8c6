"""Security on the command line: TLS and token flags, the ``certs`` and ``token`` commands.

Every client command takes ``--tls-*`` and ``--token``/``--token-file``; the daemons take
``--tls-*`` and ``--auth-*``, which replace their config's ``tls`` and ``auth`` sections.

Client flags fall back to environment variables (``NEUROSHARD_TLS_CA``, ``NEUROSHARD_TLS_CERT``,
``NEUROSHARD_TLS_KEY``, ``NEUROSHARD_TOKEN``, ``NEUROSHARD_TOKEN_FILE``), so that
``. DATA_DIR/client.env`` after ``neuroshard up --secure`` sets up a shell. Heavy modules
(grpc, cryptography) are imported only when a command needs them.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    from shared.security.transport import ChannelSecurity

ROLES = ("worker", "reader", "writer", "admin")  # shared.tokens.ROLES (no jwt import here)
_ENV = {
    "tls_ca": "NEUROSHARD_TLS_CA",
    "tls_cert": "NEUROSHARD_TLS_CERT",
    "tls_key": "NEUROSHARD_TLS_KEY",
    "token": "NEUROSHARD_TOKEN",
    "token_file": "NEUROSHARD_TOKEN_FILE",
}


def add_tls_flags(parser: argparse.ArgumentParser, suppress: bool = False) -> None:
    """Add ``--tls-ca``, ``--tls-cert`` and ``--tls-key`` (all three or none) to ``parser``.

    Args:
        parser: the command's parser.
        suppress: leave the attributes unset when a flag is absent, so that a subcommand's
            flags do not overwrite the same flags given before the subcommand.
    """
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
    """Add the TLS flags and ``--token``/``--token-file`` of a client command to ``parser``.

    Args:
        parser: the command's parser.
        suppress: as in ``add_tls_flags``.
    """
    add_tls_flags(parser, suppress)
    default = argparse.SUPPRESS if suppress else None
    parser.add_argument("--token", default=default, help="bearer token (or $NEUROSHARD_TOKEN)")
    parser.add_argument(
        "--token-file",
        default=default,
        metavar="FILE",
        help="file holding the bearer token (or $NEUROSHARD_TOKEN_FILE)",
    )


def add_client_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    help_: str,
    func: Callable[[argparse.Namespace], int],
) -> argparse.ArgumentParser:
    """Add subcommand ``name`` running ``func``, with ``--coordinator`` and the client flags.

    The flags default to ``argparse.SUPPRESS``, so they are accepted before or after the
    subcommand without one hiding the other.

    Args:
        sub: the parent command's subparsers (``neuroshard data``, ``neuroshard memory``).
        name: the subcommand.
        help_: its one-line help; ``func``'s docstring is its description.
        func: what it runs; returns the exit code.

    Returns:
        The subcommand's parser, for its own arguments.
    """
    sp = sub.add_parser(name, help=help_, description=func.__doc__)
    sp.add_argument(
        "--coordinator",
        default=argparse.SUPPRESS,
        help="coordinator HOST:PORT (default $NEUROSHARD_COORDINATOR or localhost:50051)",
    )
    add_client_flags(sp, suppress=True)
    sp.set_defaults(func=func)
    return sp


def add_daemon_flags(parser: argparse.ArgumentParser) -> None:
    """Add a daemon's TLS flags and ``--auth-*-file`` flags to ``parser``.

    The flags replace the config's ``tls`` and ``auth`` sections (``daemon_overrides``).
    """
    add_tls_flags(parser)
    parser.add_argument(
        "--auth-public-key-file",
        metavar="PEM",
        help="require tokens signed by the key pair of this Ed25519 public key "
        "(auth.public_key_file)",
    )
    parser.add_argument(
        "--auth-private-key-file",
        metavar="PEM",
        help="coordinator only: the private key that signs its own token (auth.private_key_file)",
    )
    parser.add_argument(
        "--auth-token-file",
        metavar="FILE",
        help="token this daemon presents (auth.token_file; required on a worker)",
    )


def daemon_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Return the config overrides (``tls``, ``auth``) a daemon's flags give.

    Returns:
        ``{"tls": {...}, "auth": {...}}`` for the sections whose flags were given; empty
        when none were.

    Raises:
        ConfigError: only some of the TLS flags, or an --auth-* flag without
            --auth-public-key-file.
    """
    from shared.config import ConfigError

    out: dict[str, Any] = {}
    files = [args.tls_ca, args.tls_cert, args.tls_key]
    if any(files):
        if not all(files):
            raise ConfigError("--tls-ca, --tls-cert and --tls-key: give all three or none")
        out["tls"] = {"ca_file": args.tls_ca, "cert_file": args.tls_cert, "key_file": args.tls_key}
    if args.auth_public_key_file:
        out["auth"] = {
            "public_key_file": args.auth_public_key_file,
            "private_key_file": args.auth_private_key_file,
            "token_file": args.auth_token_file,
        }
    elif args.auth_private_key_file or args.auth_token_file:
        flag = "--auth-private-key-file" if args.auth_private_key_file else "--auth-token-file"
        raise ConfigError(f"{flag}: needs --auth-public-key-file")
    return out


def client_security_of(args: argparse.Namespace) -> ChannelSecurity:
    """Return the ``ChannelSecurity`` of a client command from its flags and the environment.

    A flag wins over its ``NEUROSHARD_*`` environment variable.

    Raises:
        ConfigError: incomplete TLS flags, a missing or invalid file (names the flag).
    """
    from shared.security.transport import client_security

    values = {k: getattr(args, k, None) or os.environ.get(env) or None for k, env in _ENV.items()}
    return client_security(**values)


def cmd_certs(args: argparse.Namespace) -> int:
    """Run ``neuroshard certs DIR --hosts a,b``: write a development CA and certificates."""
    from shared.security.certs import write_dev_certs

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
    """Run ``neuroshard token create``: print a token signed with the private key.

    Flags: ``--role R --subject S [--names P] [--ttl 7d] --private-key-file F``.

    Raises:
        ConfigError: a bad role, subject, pattern or lifetime, or an unreadable key (exit
            code 2); the message names the flag.
    """
    from shared.config import ConfigError
    from shared.security.tokens import KeyFileError, create_token, parse_ttl, read_private_key

    try:
        ttl_s = parse_ttl(args.ttl)
        key = read_private_key(args.private_key_file, "--private-key-file")
        print(create_token(key, args.role, args.subject, ttl_s, names=args.names))
    except (ValueError, KeyFileError) as exc:  # KeyFileError is a ValueError
        message = str(exc)
        if message.startswith(("subject:", "names:", "ttl:")):
            message = "--" + message
        raise ConfigError(message) from None
    return 0


def cmd_token_keygen(args: argparse.Namespace) -> int:
    """Run ``neuroshard token keygen DIR``: write a new Ed25519 token key pair.

    ``private.pem`` (mode 0600) belongs to the coordinator only; ``public.pem`` to every
    daemon.

    Raises:
        ConfigError: DIR holds a private key already (exit code 2).
    """
    from shared.config import ConfigError
    from shared.security.tokens import write_keypair

    try:
        private, public = write_keypair(args.dir)
    except FileExistsError:
        raise ConfigError(
            f"{args.dir}: holds a private key already (tokens signed with it would stop "
            "working); remove it first to replace the pair"
        ) from None
    print(
        f"wrote {private} (mode 0600: auth.private_key_file of the coordinator only) and "
        f"{public} (auth.public_key_file of every daemon)",
        file=sys.stderr,
    )
    return 0


def add_security_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``certs`` and ``token keygen|create`` to the top-level subcommands ``sub``."""
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

    t = sub.add_parser("token", help="make the token key pair and signed tokens")
    tsub = t.add_subparsers(dest="token_command", required=True, metavar="COMMAND")
    tk = tsub.add_parser("keygen", help="write a new Ed25519 key pair into DIR")
    tk.add_argument("dir", metavar="DIR", help="directory for private.pem and public.pem")
    tk.set_defaults(func=cmd_token_keygen)
    tc = tsub.add_parser("create", help="print a token signed with the private key")
    tc.add_argument("--role", required=True, choices=ROLES)
    tc.add_argument(
        "--subject", required=True, help="who the token is for (a person, or a worker's name)"
    )
    tc.add_argument(
        "--names",
        metavar="PATTERN",
        help="worker tokens: also register as names matching PATTERN (fnmatch, e.g. "
        "'neuroshard-worker-*' for a StatefulSet's pods)",
    )
    tc.add_argument("--ttl", default="1h", help="lifetime: 90s, 30m, 1h, 7d (default 1h)")
    tc.add_argument(
        "--private-key-file",
        required=True,
        metavar="PEM",
        help="the coordinator's auth.private_key_file",
    )
    tc.set_defaults(func=cmd_token_create)
