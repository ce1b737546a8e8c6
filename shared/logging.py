"""structlog set-up: JSON lines when stderr is not a TTY, readable console output otherwise."""

from __future__ import annotations

import logging
import sys

import structlog
from structlog.typing import FilteringBoundLogger

from shared.config import LogConfig


def configure_logging(cfg: LogConfig | None = None) -> None:
    """Configure structlog (and the stdlib root logger) once per process.

    Event names are snake_case with key/value fields, e.g.
    ``log.info("worker_registered", worker="w0", address="127.0.0.1:5000")``. Context
    variables bound per RPC (``rpc``, ``worker``, ``job_id``) are merged into every line.
    Libraries that log through the stdlib (grpc, ...) show warnings and above only.

    Args:
        cfg: the daemon's ``log`` section; None uses the defaults (info, auto format).
    """
    cfg = cfg or LogConfig()
    level = getattr(logging, cfg.level.upper())
    as_json = cfg.format == "json" or (cfg.format == "auto" and not sys.stderr.isatty())
    renderer = (
        structlog.processors.JSONRenderer()
        if as_json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(level, logging.WARNING), stream=sys.stderr)


def get_logger(name: str) -> FilteringBoundLogger:
    """Return a structlog logger whose lines carry ``component=name``.

    Call it as ``log = get_logger(__name__)``, so ``component`` is the module's dotted path
    (``coordinator.placement.rebalance``).

    Safe to call at import time: the logger takes the configuration current at its first
    use, so ``configure_logging`` may run later.
    """
    logger: FilteringBoundLogger = structlog.get_logger(component=name)
    return logger
