"""Entry points: the only way a job spec names code (docs/architecture.md, "Trust boundaries").

The operator lists entry points in the daemons' config, a name mapped to a target
``package.module:attribute`` (``allowed_models: {small_cnn: "mymodels.vision:small_cnn"}``);
a spec names only the entry (``model: {entry: small_cnn, args: {...}}``). Resolving one:

1. the name must be a key of the daemon's table (else PERMISSION_DENIED);
2. the target is ``module:attribute`` with ONE public attribute: no dots, no leading
   underscore (so no dunder), a dotted module of identifiers without private parts;
3. the module is imported (it is the operator's), and the attribute is read from the module's
   own namespace (``vars(module)``, no ``__getattr__`` hook);
4. the object must be a function or a class *defined in* that module or a module under it
   (``obj.__module__``): a name imported into the module from elsewhere (``from os import
   system``, ``import os``) is refused;
5. the spec's ``args`` are bound to the factory's signature (``inspect.signature``): an
   unknown or a missing argument is INVALID_ARGUMENT naming it, before anything is called.

The same rule serves every kind of code a spec can name (models today; losses, data and
metrics later): one table per kind in the config, one call of :func:`resolve_entry_point`.
Nothing here imports torch.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from pydantic import BaseModel

from shared.config import ENTRY_TABLE_KEY, TRUST_KEY, check_entry_target


class EntryPointRefused(PermissionError):
    """A spec names code the daemon's operator did not list (PERMISSION_DENIED).

    The entry is not in the daemon's table, or its target is not one public function or
    class defined in the listed module. The message names the spec key and the entry.
    """


class EntryPointError(ValueError):
    """A listed entry point cannot be used as the spec asks (INVALID_ARGUMENT).

    Its ``args`` do not fit the factory's signature (the message names the argument), or the
    listed module cannot be imported.
    """


def resolve_entry_point(
    kind: str,
    name: str,
    table: Mapping[str, str],
    args: Mapping[str, Any],
    daemon: str = "coordinator",
    table_key: str | None = None,
) -> Callable[[], object]:
    """Resolve a listed entry point and bind the spec's arguments to it, calling nothing.

    Args:
        kind: what the entry builds, as the config key names its table and the spec key
            names the entry: ``model`` (table ``allowed_models``, key ``model.entry``).
        name: the entry name the spec gives.
        table: the daemon's table, entry name -> ``package.module:attribute``.
        args: the spec's keyword arguments for the factory.
        daemon: ``coordinator`` or ``worker NAME``, for the messages.
        table_key: the config key of ``table``, for the messages; default ``allowed_{kind}s``.

    Returns:
        A callable of no arguments that calls the factory with ``args``.

    Raises:
        EntryPointRefused: ``name`` is not in ``table``, or its target is malformed, missing
            from the module, not a function or class, or defined in another module
            (PERMISSION_DENIED).
        EntryPointError: the listed module cannot be imported, or ``args`` do not bind to
            the factory's signature (INVALID_ARGUMENT).
    """
    key, table_key = f"{kind}.entry", table_key or f"allowed_{kind}s"
    target = table.get(name)
    if target is None:
        listed = ", ".join(sorted(table)) or "nothing"
        raise EntryPointRefused(
            f"{key}: {name!r} is not in the {daemon}'s {table_key} (listed: {listed}); an "
            f"operator must list it as {name}: 'package.module:function'"
        )
    where = f"{key}: {name!r} ({target})"
    try:
        check_entry_target(target)
    except ValueError as exc:
        raise EntryPointRefused(f"{where}: {exc}") from None
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise EntryPointError(f"{where}: cannot import {module_name!r}: {exc!r}") from None
    factory = vars(module).get(attr)
    if factory is None:
        raise EntryPointRefused(f"{where}: {module_name} defines no {attr!r}")
    if not (inspect.isfunction(factory) or inspect.isclass(factory)):
        raise EntryPointRefused(
            f"{where}: {type(factory).__name__} is not a function or class defined in {module_name}"
        )
    defined_in = str(getattr(factory, "__module__", ""))
    if defined_in != module_name and not defined_in.startswith(module_name + "."):
        raise EntryPointRefused(
            f"{where}: {attr!r} is defined in {defined_in!r}, not in {module_name}; list the "
            f"module that defines it"
        )
    bind_args(where, factory, args)
    return functools.partial(factory, **args)


def bind_args(where: str, factory: Callable[..., object], args: Mapping[str, Any]) -> None:
    """Check that ``factory(**args)`` fits its signature, without calling it.

    Args:
        where: prefix of the messages (the spec key and the entry).
        factory: a function or class.
        args: keyword arguments.

    Raises:
        EntryPointError: an argument the factory does not take (also one it takes only
            positionally), a required one missing, or a signature that cannot be read
            (INVALID_ARGUMENT).
    """
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError) as exc:
        raise EntryPointError(f"{where}: its signature cannot be read ({exc})") from None
    params = sig.parameters
    by_keyword = {
        n
        for n, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    unknown = sorted(a for a in args if a not in by_keyword and not takes_any)
    if unknown:
        takes = ", ".join(sorted(by_keyword)) or "no arguments"
        raise EntryPointError(
            f"{where}: unknown argument {unknown[0]!r} in args (it takes {takes})"
        )
    missing = [
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        and n not in args
    ]
    if missing:
        raise EntryPointError(f"{where}: missing required argument {missing[0]!r} in args")
    try:
        sig.bind(**args)
    except TypeError as exc:
        raise EntryPointError(f"{where}: args do not fit its signature ({exc})") from None


def spec_entries(spec: BaseModel, prefix: str = "") -> Iterator[tuple[str, str, str, BaseModel]]:
    """List every entry point a spec names, through nested models.

    A field names an entry point when ``shared.config`` marks it (``MODEL_ENTRY_REF``); its
    model's ``args`` field holds the factory's arguments.

    Yields:
        ``(kind, table_key, name, part)``: the dotted spec key of the part (``model``), the
        config key of the table the entry is looked up in (``allowed_models``), the entry
        name, and the spec part holding the entry and its ``args``.
    """
    for field_name, field in type(spec).model_fields.items():
        value = getattr(spec, field_name)
        extra = field.json_schema_extra
        if isinstance(extra, dict) and extra.get(TRUST_KEY) == "entry":
            if value is not None:
                yield prefix.rstrip("."), str(extra[ENTRY_TABLE_KEY]), str(value), spec
        elif isinstance(value, BaseModel):
            yield from spec_entries(value, f"{prefix}{field.alias or field_name}.")


def check_entries(
    spec: BaseModel, tables: Mapping[str, Mapping[str, str]], daemon: str = "coordinator"
) -> None:
    """Resolve every entry point a spec names and bind its args, calling nothing.

    Args:
        spec: a validated job spec.
        tables: the daemon's tables by config key (``{"allowed_models": {...}}``); a table
            not given is empty, so an entry field added later is refused until it is wired.
        daemon: ``coordinator`` or ``worker NAME``, for the messages.

    Raises:
        EntryPointRefused: as ``resolve_entry_point`` (PERMISSION_DENIED).
        EntryPointError: as ``resolve_entry_point`` (INVALID_ARGUMENT).
    """
    for kind, table_key, name, part in spec_entries(spec):
        args = getattr(part, "args", None) or {}
        resolve_entry_point(kind, name, tables.get(table_key, {}), args, daemon, table_key)
