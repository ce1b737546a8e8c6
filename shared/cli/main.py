"""The ``neuroshard`` command line (argparse).

Exit codes: 0 success; 1 job failed or server error; 2 bad usage or invalid job spec.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import grpc

from shared.cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    example_job,
    read_job_spec,
    run_event_loop,
)
from shared.cli.link import add_link_command
from shared.cli.security import (
    add_client_flags,
    add_daemon_flags,
    add_security_commands,
    client_security_of,
    daemon_overrides,
)
from shared.cli.tensorboard import add_tensorboard_command
from shared.config import (
    ConfigError,
    CoordinatorConfig,
    WorkerConfig,
    load_config,
)
from shared.logging import configure_logging
from shared.private_files import restrict_umask

# The two daemons' configs; each daemon's ``serve`` takes its own.
DaemonConfig = TypeVar("DaemonConfig", CoordinatorConfig, WorkerConfig)


def _run_daemon(
    model: type[DaemonConfig],
    serve: Callable[[DaemonConfig, str | None], Coroutine[Any, Any, None]],
    args: argparse.Namespace,
    **own: Any,
) -> int:
    """Load a daemon's config, set up logging, and run its ``serve`` on uvloop to the end.

    Flags override the YAML config, which overrides the defaults. Asyncio's own loop runs
    ``serve`` where uvloop is missing.

    Args:
        model: the daemon's config class.
        serve: the daemon's ``serve(cfg, ready_file)``.
        args: the parsed command line (``--config``, the flags both daemons take).
        **own: the overrides of the daemon's own flags (None keeps the config's).

    Raises:
        ConfigError: an invalid config or flag (exit code 2).
    """
    cfg = load_config(
        model,
        args.config,
        listen=args.listen,
        data_dir=args.data_dir,
        metrics_port=args.metrics_port,
        **own,
        **exposure_overrides(args),
        **daemon_overrides(args),
    )
    configure_logging(cfg.log)
    restrict_umask()  # data dirs 0700, files 0600: also what libraries create (SQLite, torch)
    main = serve(cfg, args.ready_file)
    run_event_loop(main)
    return EXIT_OK


def cmd_coordinator(args: argparse.Namespace) -> int:
    """Run ``neuroshard coordinator``: the coordinator, until SIGTERM or SIGINT.

    Flags override the YAML config, which overrides the defaults. The server is imported
    here, lazily, so that client commands load no daemon code.

    Raises:
        ConfigError: an invalid config or flag (exit code 2).
    """
    from coordinator.server import serve

    return _run_daemon(
        CoordinatorConfig,
        serve,
        args,
        dashboard_port=args.dashboard_port,
        dashboard_host=args.dashboard_host,
    )


def cmd_worker(args: argparse.Namespace) -> int:
    """Run ``neuroshard worker``: a worker, until SIGTERM (it hands its slots over first).

    Flags override the YAML config, which overrides the defaults.

    Raises:
        ConfigError: an invalid config or flag (exit code 2).
    """
    from worker.server import serve

    return _run_daemon(
        WorkerConfig,
        serve,
        args,
        coordinator=args.coordinator,
        name=args.name,
        advertise_host=args.advertise_host,
        advertise_address=args.advertise_address,
        device=args.device,
    )


def _add_daemon_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    command: tuple[str, str, Callable[[argparse.Namespace], int]],
    listen_default: str,
    data_dir_help: str,
) -> argparse.ArgumentParser:
    """Add the command that runs a daemon, with the flags both daemons take (``_run_daemon``).

    Args:
        sub: the subcommands of ``neuroshard``.
        command: the daemon's name (that of its example config too), help line and function.
        listen_default: the ``--listen`` default, for the help.
        data_dir_help: the help of ``--data-dir``.

    Returns:
        The command's parser, for the daemon's own flags.
    """
    name, help_line, func = command
    p = sub.add_parser(name, help=help_line)
    p.add_argument("--config", help=f"YAML config (configs/{name}.yaml)")
    p.add_argument("--listen", help=f"HOST:PORT to serve on (default {listen_default})")
    p.add_argument("--data-dir", help=data_dir_help)
    p.add_argument("--metrics-port", type=int, help="Prometheus port (0: any free port)")
    p.add_argument("--ready-file", help=argparse.SUPPRESS)
    add_exposure_flags(p)
    add_daemon_flags(p)
    p.set_defaults(func=func)
    return p


def add_exposure_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--insecure``, ``--metrics-host`` and ``--probe-port``, flags of both daemons."""
    parser.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="allow serving beyond loopback without TLS and auth (insecure; warned at start)",
    )
    parser.add_argument(
        "--metrics-host", help="address the Prometheus endpoint binds (default 127.0.0.1)"
    )
    parser.add_argument(
        "--probe-port", type=int, help="plaintext port serving only grpc.health.v1 (probes)"
    )


def exposure_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Return the config overrides of :func:`add_exposure_flags` (None keeps the config's)."""
    return {
        "insecure": args.insecure,
        "metrics_host": args.metrics_host,
        "probe_port": args.probe_port,
    }


def cmd_submit(args: argparse.Namespace) -> int:
    """Run ``neuroshard submit``: send a job spec; with ``--follow``, watch it to the end.

    Returns:
        0 when the job was queued (without ``--follow``) or succeeded, 1 otherwise.
    """
    from shared.cli.output import follow_job
    from shared.client import SyncClient

    spec = read_job_spec(args.spec)
    with SyncClient(args.coordinator, security=client_security_of(args)) as client:
        job = client.submit(spec)
        if not args.follow:
            print(json.dumps(job.summary()) if args.json else job.job_id)
            return EXIT_OK
        final = follow_job(client, job, as_json=args.json)
    return EXIT_OK if final.state == "SUCCEEDED" else EXIT_FAILED


def cmd_status(args: argparse.Namespace) -> int:
    """Run ``neuroshard status``: print the workers, job counts and slot figures."""
    from shared.cli.output import print_status
    from shared.client import SyncClient

    with SyncClient(args.coordinator, security=client_security_of(args)) as client:
        status = client.status()
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print_status(status)
    return EXIT_OK


def cmd_jobs(args: argparse.Namespace) -> int:
    """Run ``neuroshard jobs``: print every job the caller may see, with its state."""
    from shared.cli.output import print_jobs
    from shared.client import SyncClient

    with SyncClient(args.coordinator, security=client_security_of(args)) as client:
        jobs = client.jobs()
    if args.json:
        print(json.dumps([j.summary() | {"workers": j.workers} for j in jobs], indent=2))
    else:
        print_jobs(jobs)
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    """Run ``neuroshard cancel ID`` and print the job's state afterwards.

    Raises:
        NeuroshardError: NOT_FOUND for an unknown id (exit code 1).
    """
    from shared.client import SyncClient

    with SyncClient(args.coordinator, security=client_security_of(args)) as client:
        job = client.cancel(args.job_id)
    print(f"{job.job_id} {job.state}")
    return EXIT_OK


def cmd_grant(args: argparse.Namespace) -> int:
    """Run ``neuroshard grant ID [--epochs N]``: let a paced job run N more epochs (RunEpochs).

    Prints the epochs granted to the job so far.

    Raises:
        NeuroshardError: NOT_FOUND (unknown, or another client's job), PERMISSION_DENIED (a
            reader), INVALID_ARGUMENT (N < 1), FAILED_PRECONDITION (not paced, ended,
            finishing, or past the spec's ``epochs``); exit code 1.
    """
    from shared.client import SyncClient

    with SyncClient(args.coordinator, security=client_security_of(args)) as client:
        granted = client.run_epochs(args.job_id, args.epochs)
    print(f"{args.job_id} epochs granted: {granted}")
    return EXIT_OK


def cmd_finish(args: argparse.Namespace) -> int:
    """Run ``neuroshard finish ID``: end a paced job at its next epoch boundary (FinishJob).

    Raises:
        NeuroshardError: as ``grant`` (FAILED_PRECONDITION: not paced or ended); exit code 1.
    """
    from shared.client import SyncClient

    with SyncClient(args.coordinator, security=client_security_of(args)) as client:
        job = client.finish(args.job_id)
    print(f"{job.job_id} {job.state}")
    return EXIT_OK


def cmd_up(args: argparse.Namespace) -> int:
    """Run ``neuroshard up``: a local cluster in the foreground (see ``local.run_up``).

    Raises:
        ConfigError: the ``--links`` file is invalid (exit code 2).
        CliError: its number of entries is not ``--workers`` (exit code 2).
    """
    from shared.cli.local import run_up
    from shared.netem.link_settings import load_links

    links = load_links(args.links) if args.links else None
    workers = args.workers if args.workers is not None else len(links) if links else 3
    if links is not None and len(links) != workers:
        raise CliError(
            f"--links {args.links}: {len(links)} entries for {workers} workers; give one per "
            "worker (null for a direct link)",
            EXIT_USAGE,
        )
    return run_up(
        workers,
        args.port,
        args.data_dir,
        secure=args.secure,
        links=links,
        coordinator_config=args.coordinator_config,
        worker_config=args.worker_config,
    )


def cmd_demo(args: argparse.Namespace) -> int:
    """Run ``neuroshard demo``: a local cluster, one job (the digits MLP by default), stop."""
    from shared.cli.local import run_demo

    job = args.job or example_job("digits-mlp.yaml")
    return run_demo(args.workers, job, as_json=args.json, secure=args.secure)


def build_parser() -> argparse.ArgumentParser:
    """Build the argparse parser of every ``neuroshard`` command.

    Each subcommand sets ``func``, the ``cmd_*`` function that runs it.
    """
    p = argparse.ArgumentParser(prog="neuroshard", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    c = _add_daemon_command(
        sub,
        ("coordinator", "run the coordinator daemon", cmd_coordinator),
        listen_default="127.0.0.1:50051",
        data_dir_help="directory for models and state",
    )
    c.add_argument(
        "--dashboard-port", type=int, help="live web dashboard port (0: any free port; default off)"
    )
    c.add_argument("--dashboard-host", help="address the dashboard binds (default 127.0.0.1)")
    w = _add_daemon_command(
        sub,
        ("worker", "run a worker daemon", cmd_worker),
        listen_default="127.0.0.1:0",
        data_dir_help="directory for slot data",
    )
    w.add_argument("--coordinator", help="coordinator HOST:PORT (default localhost:50051)")
    w.add_argument("--name", help="worker name (default: the hostname)")
    w.add_argument(
        "--advertise-host", help="host others reach this worker at, e.g. its pod DNS name"
    )
    w.add_argument(
        "--advertise-address",
        help="HOST:PORT registered with the coordinator, verbatim (e.g. a neuroshard link proxy)",
    )
    w.add_argument("--device", choices=["auto", "cpu", "cuda"], help="memory kernels' device")

    u = sub.add_parser("up", help="run a local cluster in the foreground (Ctrl-C stops it)")
    u.add_argument(
        "--workers", type=int, help="number of workers (default: one per --links entry, or 3)"
    )
    u.add_argument("--port", type=int, default=50051, help="coordinator port (default 50051)")
    u.add_argument("--data-dir", help="data dir (default: a temporary directory)")
    u.add_argument(
        "--secure",
        action="store_true",
        help="mutual TLS and token auth (certificates and tokens in the data dir)",
    )
    u.add_argument(
        "--links",
        help="YAML list of link settings, one per worker (null: direct), e.g. "
        "configs/links-wan.yaml; each worker sits behind a neuroshard link",
    )
    u.add_argument(
        "--coordinator-config",
        help="the coordinator's YAML config, e.g. configs/examples/coordinator.yaml (the "
        "port, data dir and security flags of up override it)",
    )
    u.add_argument(
        "--worker-config", help="every worker's YAML config, e.g. configs/examples/worker.yaml"
    )
    u.set_defaults(func=cmd_up)

    d = sub.add_parser("demo", help="local cluster of 3 workers, run the digits job, stop")
    d.add_argument("--workers", type=int, default=3)
    d.add_argument("--job", help="job YAML (default configs/jobs/digits-mlp.yaml)")
    d.add_argument("--json", action="store_true", help="print the result as JSON")
    d.add_argument("--secure", action="store_true", help="with mutual TLS and token auth")
    d.set_defaults(func=cmd_demo)

    def client_parser(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_)
        sp.add_argument(
            "--coordinator",
            help="coordinator HOST:PORT (default $NEUROSHARD_COORDINATOR or localhost:50051)",
        )
        add_client_flags(sp)
        return sp

    add_security_commands(sub)
    add_link_command(sub)
    add_tensorboard_command(sub)

    s = client_parser("submit", "submit a job spec")
    s.add_argument("spec", help="job YAML, e.g. configs/jobs/digits-mlp.yaml")
    s.add_argument("--follow", action="store_true", help="show progress until the job ends")
    s.add_argument("--json", action="store_true", help="print one JSON document")
    s.set_defaults(func=cmd_submit)

    st = client_parser("status", "show workers and jobs")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    j = client_parser("jobs", "list jobs")
    j.add_argument("--json", action="store_true")
    j.set_defaults(func=cmd_jobs)

    cn = client_parser("cancel", "cancel a job")
    cn.add_argument("job_id")
    cn.set_defaults(func=cmd_cancel)

    gr = client_parser("grant", "let a paced job run more epochs")
    gr.add_argument("job_id")
    gr.add_argument("--epochs", type=int, default=1, help="epochs to grant (default 1)")
    gr.set_defaults(func=cmd_grant)

    fi = client_parser("finish", "end a paced job at its next epoch boundary")
    fi.add_argument("job_id")
    fi.set_defaults(func=cmd_finish)

    try:
        from shared.cli.memory import add_memory_commands
    except ImportError:  # the memory commands are optional until the store exists
        pass
    else:
        add_memory_commands(client_parser("memory", "memory store operations"))
    from shared.cli.tables import add_table_commands

    add_table_commands(client_parser("table", "replay tables: create, ls, drop"))
    from shared.cli.data import add_data_commands

    add_data_commands(client_parser("data", "data sets in the coordinator's data roots"))
    from shared.cli.models import add_model_commands

    add_model_commands(client_parser("model", "train jobs' saved models"))
    from shared.cli.memory_io import add_forget_worker_command

    add_forget_worker_command(
        client_parser("forget-worker", "forget a DEAD worker that will never return (admin)")
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the ``neuroshard`` console script: parse ``argv``, run the command.

    Expected failures (``CliError``, ``ConfigError``, ``NeuroshardError``) are printed as
    one ``error:`` line on stderr rather than a traceback.

    Args:
        argv: the arguments after the program name; None reads ``sys.argv``.

    Returns:
        The exit code: 0 success, 1 failure, 2 bad usage or an INVALID_ARGUMENT refusal,
        130 after Ctrl-C.
    """
    from shared.client import NeuroshardError

    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args))
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = exc.code
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_USAGE
    except NeuroshardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = EXIT_USAGE if exc.code is grpc.StatusCode.INVALID_ARGUMENT else EXIT_FAILED
    except KeyboardInterrupt:
        code = 130
    return code
