"""Typed configuration; the next commit splits daemons.py by concern."""

from shared.config.daemons import *  # noqa: F403
