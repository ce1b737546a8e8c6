"""Entry points: only a listed name, resolving to one public function or class defined in the
listed module, with args that fit its signature; nothing is called while resolving."""

from __future__ import annotations

import pytest
from torch import nn

from shared.config import ConfigError, CoordinatorConfig, WorkerConfig, parse_job_spec
from shared.training.entry_points import (
    EntryPointError,
    EntryPointRefused,
    check_entries,
    resolve_entry_point,
)

V = "tests.fixtures.vision"


def _resolve(target: str, args: dict | None = None) -> object:
    return resolve_entry_point("model", "e", {"e": target}, args or {}, "worker w0")


@pytest.mark.parametrize(
    ("target", "message"),
    [
        (f"{V}:os.system", "no dots after ':'"),  # the attribute walk of the old import form
        (f"{V}:__init__", "no leading underscores"),
        (f"{V}:__builtins__", "no leading underscores"),
        (f"{V}:_private", "no leading underscores"),
        (f"{V}:os", "module is not a function or class defined in tests.fixtures.vision"),
        (f"{V}:system", "builtin_function_or_method is not a function or class"),
        (f"{V}:small_mlp", "'small_mlp' is defined in 'tests.fixtures.models', not in"),
        (f"{V}:WIDTH", "int is not a function or class"),
        (f"{V}:nothing_here", "tests.fixtures.vision defines no 'nothing_here'"),
        ("os:system", "builtin_function_or_method is not a function or class"),
    ],
)
def test_a_target_that_is_not_one_public_definition_is_refused(target: str, message: str) -> None:
    with pytest.raises(EntryPointRefused) as err:
        _resolve(target, {"command": "true"})

    assert str(err.value).startswith(f"model.entry: 'e' ({target}): ")
    assert message in str(err.value)


def test_an_unknown_name_is_refused_naming_the_table_and_what_is_listed() -> None:
    with pytest.raises(EntryPointRefused) as err:
        resolve_entry_point("model", "evil", {"b": "m:f", "a": "m:g"}, {}, "coordinator")

    assert str(err.value) == (
        "model.entry: 'evil' is not in the coordinator's allowed_models (listed: a, b); an "
        "operator must list it as evil: 'package.module:function'"
    )


@pytest.mark.parametrize(
    ("target", "args", "message"),
    [
        (f"{V}:tiny_linear", {"classes": 3}, "missing required argument 'features' in args"),
        (
            f"{V}:tiny_linear",
            {"features": 4, "command": "x"},
            "unknown argument 'command' in args (it takes classes, features)",
        ),
        (
            f"{V}:TinyNet",
            {"self": 1},
            "unknown argument 'self' in args (it takes classes, features, scale)",
        ),
    ],
)
def test_args_that_do_not_fit_the_signature_are_refused_before_the_call(
    target: str, args: dict, message: str
) -> None:
    with pytest.raises(EntryPointError) as err:
        _resolve(target, args)

    assert str(err.value) == f"model.entry: 'e' ({target}): {message}"


def test_a_listed_function_or_class_resolves_with_its_args_bound() -> None:
    build = _resolve(f"{V}:tiny_linear", {"features": 4, "classes": 3})
    net = _resolve(f"{V}:TinyNet", {"features": 4, "scale": 2.0})

    model, other = build(), net()

    assert isinstance(model, nn.Module) and model[1].in_features == 4
    assert isinstance(other, nn.Module) and other.scale == 2.0


def test_check_entries_walks_the_spec_and_refuses_an_entry_with_no_table() -> None:
    spec = parse_job_spec({"kind": "train", "model": {"entry": "tiny", "args": {"features": 4}}})

    check_entries(spec, {"allowed_models": {"tiny": f"{V}:tiny_linear"}})
    with pytest.raises(EntryPointRefused, match="not in the coordinator's allowed_models"):
        check_entries(spec, {})


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (
            {"import": f"{V}:os.system", "args": {"command": "touch x"}},
            "model: 'import' is no longer accepted; name an entry point the operator listed "
            "in allowed_models: {entry: NAME, args: {...}}",
        ),
        ({"entry": f"{V}:tiny_linear"}, "model.entry: expected the name of an entry point"),
        ({"entry": "a.b"}, "model.entry: expected the name of an entry point"),
        ({"entry": "__class__"}, "model.entry: expected the name of an entry point"),
    ],
)
def test_the_spec_names_an_entry_not_a_path(model: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_job_spec({"kind": "train", "model": model})

    assert str(err.value).startswith(message)


@pytest.mark.parametrize("config", [CoordinatorConfig, WorkerConfig])
def test_the_old_allowed_imports_key_names_the_new_one(config: type) -> None:
    with pytest.raises(ValueError, match="allowed_imports: removed; list model entry points"):
        config.model_validate({"allowed_imports": ["mymodels"]})


@pytest.mark.parametrize("target", [f"{V}:os.system", f"{V}:__init__", "os", "a.b:"])
def test_a_table_target_that_is_not_module_colon_name_is_a_config_error(target: str) -> None:
    with pytest.raises(ValueError, match="expected 'package.module:function'"):
        WorkerConfig.model_validate({"allowed_models": {"e": target}})
