"""``neuroshard link``: an emulated network link (``shared.netem.link_proxy``) in the foreground.

It prints the address it listens on as one line on stdout (``HOST:PORT``, the real port
when ``--listen`` asks for port 0), logs to stderr, and runs until SIGINT or SIGTERM.

The link follows the daemons' exposure rule (``shared.security.exposure``): it has no TLS and
no authentication of its own and relays whatever reaches it to its target, so a
``--listen`` host other than loopback would publish the target (a plaintext loopback
worker, say) to every machine that can reach this one. It refuses such a host unless told
``--insecure``, and then warns at start. ``--max-connections`` caps the connections it
relays at once.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any

from pydantic import ValidationError

from shared import rpc
from shared.cli.common import EXIT_OK, EXIT_USAGE, CliError, run_event_loop
from shared.config import ConfigError, format_validation_error
from shared.logging import configure_logging, get_logger
from shared.netem.link_proxy import LinkProxy, LinkSettings
from shared.security.exposure import check_listen

log = get_logger(__name__)

# What a refused --listen tells the operator (after "the link has no tls and auth; ").
_REMEDY = (
    "it relays whoever reaches it to its target; listen on 127.0.0.1, or pass --insecure to "
    "accept the risk (e.g. when the target serves mutual TLS itself)"
)


def add_link_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``neuroshard link`` to the subcommands of ``neuroshard``."""
    p = sub.add_parser(
        "link",
        help="relay TCP from --listen to --target through an emulated link (Ctrl-C stops it; "
        "SIGUSR1 cuts it, as a partition, and SIGUSR2 heals it)",
    )
    p.add_argument("--listen", required=True, help="HOST:PORT to accept on (port 0: any free)")
    p.add_argument("--target", required=True, help="HOST:PORT each connection is relayed to")
    p.add_argument(
        "--latency-ms",
        type=float,
        default=0.0,
        help="one-way delay of each direction, ms (a round trip grows by twice it)",
    )
    p.add_argument(
        "--jitter-ms", type=float, default=0.0, help="uniform +-jitter on each delay, ms"
    )
    p.add_argument("--bandwidth-mbit", type=float, help="cap of each direction, Mbit/s")
    p.add_argument(
        "--reset-every-mb", type=float, help="reset a connection after this many MB (both ways)"
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=LinkSettings.model_fields["max_connections"].default,
        help="most connections relayed at once; more are reset and counted (default: %(default)s)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow a --listen host other than loopback: anyone who reaches it reaches the "
        "target through this link, which has no TLS or authentication of its own",
    )
    p.add_argument("--ready-file", help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_link)


def _host_port(flag: str, value: str) -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[::1]:PORT`` too) given to ``flag``.

    Raises:
        CliError: not HOST:PORT with a port in 0..65535 (exit code 2).
    """
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise CliError(f"{flag}: expected HOST:PORT with a port in 0..65535, got {value!r}", 2)
    return host.removeprefix("[").removesuffix("]"), int(port)


def settings_of(args: argparse.Namespace) -> LinkSettings:
    """Validate the link's flags into settings.

    Raises:
        ConfigError: an invalid value; the message names the field (exit code 2).
    """
    fields: dict[str, Any] = {
        "latency_ms": args.latency_ms,
        "jitter_ms": args.jitter_ms,
        "bandwidth_mbit": args.bandwidth_mbit,
        "reset_every_mb": args.reset_every_mb,
        "max_connections": args.max_connections,
    }
    try:
        return LinkSettings.model_validate(fields)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def cmd_link(args: argparse.Namespace) -> int:
    """Run ``neuroshard link`` until SIGINT or SIGTERM.

    Returns:
        0 after a signal.

    Raises:
        CliError: a flag is not HOST:PORT, or the listen address cannot be bound (exit
            code 2).
        ConfigError: an invalid link setting (exit code 2).
        ExposureRefused: a non-loopback ``--listen`` without ``--insecure`` (a
            ``ConfigError``, exit code 2).
    """
    listen_host, listen_port = _host_port("--listen", args.listen)
    target_host, target_port = _host_port("--target", args.target)
    settings = settings_of(args)
    configure_logging()  # before the listen check: its warning is a log line
    # The daemons' rule: the link has neither TLS nor auth of its own, so beyond loopback it
    # needs --insecure (then it warns).
    check_listen(
        "link",
        args.listen,
        tls=False,
        auth=False,
        insecure=args.insecure,
        field="--listen",
        remedy=_REMEDY,
        hint="anyone who reaches this port reaches the target through the link",
    )
    proxy = LinkProxy(listen_host, listen_port, target_host, target_port, settings)
    main = _serve(proxy, args.ready_file)
    run_event_loop(main)
    return EXIT_OK


async def _serve(proxy: LinkProxy, ready_file: str | None) -> None:
    """Start the proxy, print its address, wait for SIGINT or SIGTERM, stop it.

    Meanwhile SIGUSR1 cuts the link (``LinkProxy.cut``) and SIGUSR2 heals it.

    Raises:
        CliError: the listen address cannot be bound.
    """
    try:
        port = await proxy.start()
    except OSError as exc:
        raise CliError(
            f"--listen: cannot listen on {proxy.listen_host}: {exc}", EXIT_USAGE
        ) from None
    address = f"{proxy.listen_host}:{port}"
    if ":" in proxy.listen_host:
        address = f"[{proxy.listen_host}]:{port}"
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, proxy.cut)  # a partition, for chaos tests
    loop.add_signal_handler(signal.SIGUSR2, proxy.heal)
    print(address, flush=True)
    await rpc.write_ready_file(ready_file, address)
    await rpc.wait_for_stop_signal()
    await proxy.stop()
