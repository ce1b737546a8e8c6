"""What every CLI command shares: exit codes, the user-facing error, reading a job spec.

Exit codes: 0 success; 1 job failed or server error; 2 bad usage or invalid job spec.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from shared.config import ConfigError, load_yaml, parse_job_spec

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
REPO_ROOT = Path(__file__).resolve().parents[2]  # shared/cli/common.py -> the checkout
# Where the container image puts the checkout's configs/ (deploy/docker/Dockerfile); an
# installed package has no checkout around it.
IMAGE_CONFIG_DIR = Path("/etc/neuroshard")


class CliError(Exception):
    """A one-line error for the user, with its exit code; ``main`` prints it and exits."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        """Carry ``message`` and the exit ``code`` (EXIT_FAILED or EXIT_USAGE)."""
        super().__init__(message)
        self.code = code


def example_job(name: str) -> str:
    """Return the path of an example job YAML, ``configs/jobs/NAME``.

    Looked up in the checkout the package runs from, else in the container image's
    ``/etc/neuroshard/jobs``.

    Raises:
        CliError: neither exists (exit code 2): the message asks for a job file.
    """
    for config_dir in (REPO_ROOT / "configs", IMAGE_CONFIG_DIR):
        path = config_dir / "jobs" / name
        if path.is_file():
            return str(path)
    raise CliError(
        f"example job configs/jobs/{name} not found (not a checkout, not the image): "
        "give a job YAML with --job",
        EXIT_USAGE,
    )


def read_job_spec(path: str) -> dict[str, Any]:
    """Read a job YAML and validate it here, so a bad spec fails before anything is sent.

    Paths in the spec are sent as written: the coordinator resolves them in its data roots.

    Returns:
        The spec as a dict, as the coordinator's SubmitJob takes it (defaults not filled in).

    Raises:
        CliError: exit code 2, one line naming the field.
    """
    try:
        data = load_yaml(path)
        parse_job_spec(data)  # raises unless data is a dict
    except ConfigError as exc:
        raise CliError(f"invalid job spec {path}: {exc}", EXIT_USAGE) from None
    spec: dict[str, Any] = data
    return spec


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run a daemon's (or the link proxy's) main coroutine on uvloop, asyncio's loop without it."""
    try:
        import uvloop

        uvloop.run(main)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux/macOS
        asyncio.run(main)
