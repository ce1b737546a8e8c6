"""structlog set-up: JSON lines when stderr is not a TTY, readable console output otherwise."""

from __future__ import annotations

import logging
import sys

import structlog

from shared.config import LogConfig


def configure_logging(cfg: LogConfig | None = None) -> None:
    """Configure structlog (and the stdlib root logger) once per process.

    Event names are snake_case with key/value fields, e.g.
    ``log.info("worker_registered", worker="w0", address="127.0.0.1:5000")``.
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


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structlog logger bound to ``component=name``."""
    return structlog.get_logger(component=name)  # type: ignore[no-any-return]
