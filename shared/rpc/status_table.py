"""Domain exceptions to gRPC status codes: one table per servicer, applied by one helper.

Each servicer lists the domain exceptions its RPCs may raise, with the status each maps to
(a ``StatusTable``), and runs the body of every RPC, unary or streaming, inside
``async with table.mapped(context):``. An exception the table names ends the call with its
status and the exception's message (``message_of``); any other exception propagates, and
grpc answers UNKNOWN: a bug to fix, not a status to add.

Rules are tried in order and the first class the exception is an instance of wins, so a
subclass is listed before its base. A rule's status is a code, or a function of the exception
returning a ``Status``: for an error carrying the status of the call it relays (a shard fetch
from the coordinator), or a refusal with trailing metadata (a retry pushback).

Request fields that fail validation in a servicer raise ``BadRequest`` naming the field;
every table maps it to INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NoReturn, TypeAlias

import grpc
from grpc import aio

__all__ = ["BadRequest", "Status", "StatusTable", "message_of"]


class BadRequest(ValueError):
    """A request field is missing or malformed (INVALID_ARGUMENT); the message names it."""


@dataclass(frozen=True)
class Status:
    """The status a call ends with.

    Attributes:
        code: the gRPC status code.
        trailing_metadata: (key, value) pairs sent with it, e.g. ``grpc-retry-pushback-ms``.
    """

    code: grpc.StatusCode
    trailing_metadata: tuple[tuple[str, str], ...] = ()


# A table's rule: a code, or the status computed from the exception.
Rule: TypeAlias = grpc.StatusCode | Callable[[Any], Status]


def message_of(exc: BaseException) -> str:
    """The status message of ``exc``: ``str(exc)``, but a KeyError's message unquoted.

    ``str(KeyError("no job"))`` is ``"'no job'"`` (its repr); the message is its argument.
    """
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    return str(exc)


class StatusTable:
    """One servicer's map from domain exceptions to the status of the call."""

    def __init__(self, rules: Sequence[tuple[type[Exception], Rule]]) -> None:
        """Map each exception class to its status; the first matching rule wins.

        Args:
            rules: (exception class, code or function of the exception returning a
                ``Status``), a subclass before its base.
        """
        self._rules = list(rules)

    @property
    def rules(self) -> list[tuple[type[Exception], Rule]]:
        """The rules in the order they are tried."""
        return list(self._rules)

    def status_of(self, exc: BaseException) -> Status | None:
        """The status ``exc`` maps to, or None when no rule names its class."""
        for cls, rule in self._rules:
            if isinstance(exc, cls):
                return Status(rule) if isinstance(rule, grpc.StatusCode) else rule(exc)
        return None

    async def abort(self, context: aio.ServicerContext[Any, Any], exc: Exception) -> NoReturn:
        """End the call with the status of ``exc``, or re-raise ``exc`` when it is not mapped.

        Raises:
            grpc.aio.AbortError: always for a mapped exception (``context.abort``).
            Exception: ``exc`` itself when no rule names its class.
        """
        status = self.status_of(exc)
        if status is None:
            raise exc
        await context.abort(status.code, message_of(exc), status.trailing_metadata)

    def mapped(self, context: aio.ServicerContext[Any, Any]) -> MappedErrors:
        """An async context manager that aborts ``context`` with the status of a mapped error.

        Wraps an RPC's body, also around ``yield`` in a streaming one: exceptions that are
        not ``Exception`` (cancellation, a closed stream's GeneratorExit) pass through.
        """
        return MappedErrors(self, context)


class MappedErrors:
    """``StatusTable.mapped``: abort on a mapped exception leaving the block."""

    def __init__(self, table: StatusTable, context: aio.ServicerContext[Any, Any]) -> None:
        """Abort ``context`` through ``table``."""
        self._table, self._context = table, context

    async def __aenter__(self) -> None:
        """Nothing to set up."""

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Abort with the exception's status when the table maps it; else let it propagate.

        Raises:
            grpc.aio.AbortError: the exception is mapped.
        """
        if isinstance(exc, Exception) and self._table.status_of(exc) is not None:
            await self._table.abort(self._context, exc)
