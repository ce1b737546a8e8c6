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

ROLES = ("reader", "writer", "admin")  # shared.tokens.ROLES (no jwt import here)
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
        help="coordinator only: the private key that mints data-plane tokens "
        "(auth.private_key_file)",
    )
    parser.add_argument(
        "--auth-revoked-file",
        metavar="FILE",
        help="revoked token ids, one per line (auth.revoked_file)",
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
            "revoked_file": args.auth_revoked_file,
        }
    elif args.auth_private_key_file or args.auth_revoked_file:
        flag = "--auth-private-key-file" if args.auth_private_key_file else "--auth-revoked-file"
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
    """Run ``neuroshard certs DIR --hosts a,b --workers w0,w1``: a development CA and certificates.

    Without ``--add-worker`` it writes a new CA, the coordinator's, the client's and the
    named workers' certificates; with it, one more worker's from the CA already in DIR.

    Raises:
        ConfigError: a worker name that is not valid, or (``--add-worker``) no CA in DIR.
    """
    from shared.config import ConfigError
    from shared.security.certs import CertPaths, issue_worker, write_dev_certs

    hosts = [h for h in (args.hosts or "").split(",") if h.strip()]
    names = ", ".join([*hosts, "localhost", "127.0.0.1"])
    try:
        if args.add_worker:
            cert, key = issue_worker(CertPaths.under(args.dir), args.add_worker, hosts)
            print(f"worker {args.add_worker}: {cert} (key {key}), hosts: {names}")
            return 0
        workers = [w.strip() for w in (args.workers or "").split(",") if w.strip()]
        paths = write_dev_certs(args.dir, hosts, workers)
    except FileNotFoundError as exc:
        raise ConfigError(f"DIR: {exc.filename}: no CA here (run neuroshard certs DIR)") from None
    except ValueError as exc:
        raise ConfigError(f"--workers: {exc}") from None
    print(f"CA:          {paths.ca_cert} (key {paths.ca_key})")
    print(f"coordinator: {paths.coordinator_cert} (key {paths.coordinator_key}), hosts: {names}")
    for w in workers:
        cert, key = paths.worker(w)
        print(f"worker {w}: {cert} (key {key}), hosts: {names}")
    print(f"client:      {paths.client_cert} (key {paths.client_key})")
    return 0


def cmd_token_create(args: argparse.Namespace) -> int:
    """Run ``neuroshard token create``: print a token signed with the private key.

    Flags: ``--role R --subject S [--ttl 7d] --private-key-file F``.

    Raises:
        ConfigError: a bad role, subject or lifetime (over the role's cap), or an unreadable
            key (exit code 2); the message names the flag.
    """
    from shared.config import ConfigError
    from shared.security.tokens import KeyFileError, create_token, parse_ttl, read_private_key

    try:
        ttl_s = parse_ttl(args.ttl)
        key = read_private_key(args.private_key_file, "--private-key-file")
        print(create_token(key, args.role, args.subject, ttl_s))
    except (ValueError, KeyFileError) as exc:  # KeyFileError is a ValueError
        message = str(exc)
        if message.startswith(("subject:", "ttl:", "role:")):
            message = "--" + message
        raise ConfigError(message) from None
    return 0


def cmd_token_revoke(args: argparse.Namespace) -> int:
    """Run ``neuroshard token revoke TOKEN_OR_ID --file F``: append its id to a revocation list.

    Daemons whose ``auth.revoked_file`` is F refuse the token within a second.

    Raises:
        ConfigError: a token without an id, or a file that cannot be written.
    """
    from shared.config import ConfigError
    from shared.security.tokens import TokenError, token_id

    value = args.token.strip()
    try:
        jti = token_id(value) if value.count(".") == 2 else value
    except TokenError as exc:
        raise ConfigError(f"TOKEN: {exc}") from None
    if not jti or any(c.isspace() or c == "#" for c in jti):
        raise ConfigError(f"TOKEN: not a token or a token id: {value!r}")
    try:
        with open(args.file, "a", encoding="utf-8") as f:
            f.write(jti + "\n")
    except OSError as exc:
        raise ConfigError(f"--file: {args.file}: {exc.strerror or exc}") from None
    print(f"revoked {jti} (in {args.file})", file=sys.stderr)
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
        help="directory to write ca.crt, coordinator.crt, workers/NAME.crt, client.crt and "
        "their keys into",
    )
    c.add_argument(
        "--hosts",
        default="",
        metavar="NAME,...",
        help="host names and IPs of the daemon certificates (localhost and 127.0.0.1 "
        "are always added; wildcards like *.svc allowed)",
    )
    c.add_argument(
        "--workers",
        default="",
        metavar="NAME,...",
        help="worker names to issue certificates for (identity spiffe://neuroshard/worker/NAME)",
    )
    c.add_argument(
        "--add-worker",
        metavar="NAME",
        help="issue one more worker certificate from the CA already in DIR",
    )
    c.set_defaults(func=cmd_certs)

    t = sub.add_parser("token", help="make the token key pair and signed tokens")
    tsub = t.add_subparsers(dest="token_command", required=True, metavar="COMMAND")
    tk = tsub.add_parser("keygen", help="write a new Ed25519 key pair into DIR")
    tk.add_argument("dir", metavar="DIR", help="directory for private.pem and public.pem")
    tk.set_defaults(func=cmd_token_keygen)
    tc = tsub.add_parser("create", help="print a token signed with the private key")
    tc.add_argument("--role", required=True, choices=ROLES)
    tc.add_argument("--subject", required=True, help="who the token is for (a person or a program)")
    tc.add_argument(
        "--ttl",
        default="1h",
        help="lifetime: 90s, 30m, 1h, 7d (default 1h; at most 30d for reader and writer, "
        "7d for admin)",
    )
    tc.add_argument(
        "--private-key-file",
        required=True,
        metavar="PEM",
        help="the coordinator's auth.private_key_file",
    )
    tc.set_defaults(func=cmd_token_create)
    tr = tsub.add_parser("revoke", help="add a token's id to a revocation list")
    tr.add_argument("token", metavar="TOKEN", help="the token, or its id (jti)")
    tr.add_argument(
        "--file",
        required=True,
        metavar="FILE",
        help="the daemons' auth.revoked_file (created if missing)",
    )
    tr.set_defaults(func=cmd_token_revoke)
