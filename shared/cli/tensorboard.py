"""``neuroshard tensorboard``: TensorBoard's own server on the coordinator's event files.

Run on the coordinator's host: the train jobs write ``DATA_DIR/tensorboard/JOB_ID/``
(``coordinator.training.tensorboard_log``), one run per job. The data dir is the
coordinator's, from ``--data-dir``, else from ``--config`` (its YAML), else the default.

TensorBoard has neither TLS nor authentication, and its pages show every job's figures, so
the command follows the daemons' exposure rule (``shared.security.exposure``): it binds
loopback by default and refuses any other ``--host`` unless told ``--insecure``, then warns.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shared.cli.common import EXIT_OK, EXIT_USAGE, CliError
from shared.config import CoordinatorConfig, load_config
from shared.logging import configure_logging
from shared.security.exposure import check_listen

DEFAULT_PORT = 6006  # TensorBoard's own default
# What a refused --host tells the operator (after "the tensorboard has no tls and auth; ").
_REMEDY = (
    "it shows every job's figures to whoever reaches it; serve on 127.0.0.1 and reach it "
    "through an SSH tunnel, or pass --insecure to accept the risk"
)


def add_tensorboard_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``neuroshard tensorboard`` to the subcommands of ``neuroshard``."""
    p = sub.add_parser(
        "tensorboard",
        help="serve the train jobs' TensorBoard event files (TensorBoard's server, in the "
        "foreground, on the coordinator's host)",
    )
    p.add_argument("--config", help="the coordinator's YAML config, for its data_dir")
    p.add_argument("--data-dir", help="the coordinator's data dir (wins over --config)")
    p.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="port (0: any free; default %(default)s)"
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow a --host other than loopback: TensorBoard has no TLS or authentication",
    )
    p.set_defaults(func=cmd_tensorboard)


def log_dir_of(args: argparse.Namespace) -> Path:
    """The directory to serve: ``DATA_DIR/tensorboard`` of the coordinator's config.

    Raises:
        ConfigError: the ``--config`` file is missing or invalid (exit code 2).
        CliError: the port is outside 0..65535, or the data dir does not exist (exit code 2).
    """
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port: expected 0..65535, got {args.port}", EXIT_USAGE)
    cfg = load_config(CoordinatorConfig, args.config, data_dir=args.data_dir)
    if not Path(cfg.data_dir).expanduser().is_dir():
        raise CliError(
            f"data_dir: {cfg.data_dir} is not a directory; give the coordinator's --data-dir "
            "or --config",
            EXIT_USAGE,
        )
    return cfg.tensorboard_dir()


def check_host(args: argparse.Namespace) -> None:
    """Apply the exposure rule to ``--host``.

    Raises:
        ExposureRefused: a non-loopback host without ``--insecure`` (a ``ConfigError``: exit
            code 2).
    """
    check_listen(
        "tensorboard",
        f"{args.host}:{args.port}",
        tls=False,
        auth=False,
        insecure=args.insecure,
        field="--host",
        remedy=_REMEDY,
        hint="anyone who reaches this port sees every job's figures",
    )


def cmd_tensorboard(args: argparse.Namespace) -> int:
    """Run ``neuroshard tensorboard`` until Ctrl-C or SIGTERM.

    TensorBoard prints ``TensorBoard X at http://HOST:PORT/`` on stderr once it listens.

    Returns:
        0 after Ctrl-C or SIGTERM.

    Raises:
        CliError: a bad flag, a missing data dir, or TensorBoard could not serve (a port in
            use, an address it cannot bind) (exit code 2).
        ConfigError: an invalid ``--config`` (exit code 2).
        ExposureRefused: a non-loopback ``--host`` without ``--insecure`` (exit code 2).
    """
    log_dir = log_dir_of(args)
    configure_logging()  # before the host check: its warning is a log line
    check_host(args)
    log_dir.mkdir(parents=True, exist_ok=True, mode=0o700)  # no job yet: serve it empty
    serve(log_dir, args.host, args.port)
    return EXIT_OK


def serve(log_dir: Path, host: str, port: int) -> None:
    """Run TensorBoard's server (``tensorboard.program``) on ``log_dir`` in the foreground.

    ``load_fast=false``: TensorBoard reads the files in this process rather than starting
    its Rust data server as a child process.

    Args:
        log_dir: the directory of run directories.
        host: the address to bind.
        port: the port; 0 picks a free one (TensorBoard prints the one bound).

    Raises:
        CliError: TensorBoard could not serve (exit code 2).
    """
    from tensorboard import program  # imported here: only this command needs it

    board = program.TensorBoard()
    board.configure(logdir=str(log_dir), host=host, port=port, load_fast="false")
    if board.main() != 0:  # its error is already on stderr
        raise CliError(f"tensorboard could not serve on {host}:{port}", EXIT_USAGE)
