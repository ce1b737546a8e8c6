"""Built-in and entry-point models: shapes, seeded initialisation, clear errors."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from shared.config import CnnSpec, EntryModelSpec, MlpSpec
from shared.training.entry_points import EntryPointRefused
from shared.training.models import (
    ModelError,
    activation_bytes,
    build_model,
    check_param_arrays,
    count_params,
    param_shapes,
)


def tiny_linear(features: int, classes: int) -> nn.Module:
    """An importable model factory for the tests below."""
    return nn.Linear(features, classes)


def not_a_module() -> str:
    return "nope"


def broken() -> nn.Module:
    raise RuntimeError("boom")


@pytest.mark.parametrize(
    ("spec", "input_shape"),
    [
        (MlpSpec(hidden=[16, 8]), (1, 8, 8)),
        (MlpSpec(hidden=[]), (64,)),
        (CnnSpec(channels=[4, 8]), (1, 8, 8)),
        (CnnSpec(channels=[4, 8]), (1, 28, 28)),
    ],
)
def test_builtin_models_map_a_batch_to_logits(spec: MlpSpec | CnnSpec, input_shape: tuple) -> None:
    model = build_model(spec, input_shape, num_classes=10, seed=0)

    logits = model(torch.zeros(5, *input_shape))

    assert logits.shape == (5, 10) and logits.dtype == torch.float32
    assert not any(isinstance(m, nn.BatchNorm2d | nn.Dropout) for m in model.modules())


def test_mlp_layers_follow_hidden() -> None:
    model = build_model(MlpSpec(hidden=[32, 16]), (1, 8, 8), 10, seed=0)

    shapes = param_shapes(model)

    assert [s for s in shapes.values() if len(s) == 2] == [(32, 64), (16, 32), (10, 16)]


def test_init_is_seeded_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)

    a = build_model(MlpSpec(), (64,), 10, seed=5)
    b = build_model(MlpSpec(), (64,), 10, seed=5)
    c = build_model(MlpSpec(), (64,), 10, seed=6)

    assert torch.equal(torch.rand(1), before)
    for (_, pa), (_, pb), (_, pc) in zip(
        a.named_parameters(), b.named_parameters(), c.named_parameters(), strict=True
    ):
        assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_cnn_rejects_other_input_shapes() -> None:
    with pytest.raises(ModelError, match=r"input shape \(64,\) is not supported"):
        build_model(CnnSpec(), (64,), 10, seed=0)
    with pytest.raises(ModelError, match="expected 2 conv widths"):
        build_model(CnnSpec(channels=[4, 8, 16]), (1, 8, 8), 10, seed=0)


ENTRIES = {
    "tiny": f"{__name__}:tiny_linear",
    "not_a_module": f"{__name__}:not_a_module",
    "broken": f"{__name__}:broken",
    "missing_pkg": "no_such_pkg.mod:fn",
}


def test_an_entry_builds_a_seeded_module() -> None:
    spec = EntryModelSpec(entry="tiny", args={"features": 64, "classes": 10})

    a = build_model(spec, (64,), 10, seed=1, allowed_models=ENTRIES)
    b = build_model(spec, (64,), 10, seed=1, allowed_models=ENTRIES)

    assert isinstance(a, nn.Linear) and torch.equal(a.weight, b.weight)


def test_an_unlisted_entry_is_refused_before_importing(monkeypatch: pytest.MonkeyPatch) -> None:
    imported: list[str] = []
    real_import = importlib.import_module
    monkeypatch.setattr(
        importlib, "import_module", lambda name, *a: imported.append(name) or real_import(name)
    )
    spec = EntryModelSpec(entry="system", args={"command": "true"})

    with pytest.raises(
        EntryPointRefused,
        match=r"^model.entry: 'system' is not in the worker w0's allowed_models \(listed: mine\)",
    ):
        build_model(spec, (64,), 10, seed=0, allowed_models={"mine": "m:f"}, daemon="worker w0")

    assert imported == []


def test_meta_device_counts_params_without_allocating() -> None:
    model = build_model(MlpSpec(hidden=[32]), (1, 8, 8), 10, seed=0, device="meta")

    assert count_params(model) == 64 * 32 + 32 + 32 * 10 + 10
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("missing_pkg", "cannot import 'no_such_pkg.mod'"),
        ("not_a_module", "returned str, expected a torch.nn.Module"),
        ("broken", "call failed: RuntimeError('boom')"),
        ("tiny", "missing required argument 'features' in args"),  # checked before the call
    ],
)
def test_entry_errors_name_the_entry(entry: str, message: str) -> None:
    spec = EntryModelSpec(entry=entry)

    with pytest.raises(ModelError) as err:
        build_model(spec, (64,), 10, seed=0, allowed_models=ENTRIES)

    assert f"model.entry: {entry!r}" in str(err.value) and message in str(err.value)


def test_activation_bytes_counts_every_layer_output_on_meta() -> None:
    model = build_model(MlpSpec(hidden=[32]), (1, 8, 8), 10, seed=0, device="meta")

    got = activation_bytes(model, (1, 8, 8), rows=100)

    # input 64, Flatten 64, Linear 32, ReLU 32, Linear 10: float32 per row
    assert got == 100 * (64 + 64 + 32 + 32 + 10) * 4


def test_activation_bytes_is_none_when_the_forward_does_not_run_on_meta() -> None:
    class ItemNet(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * float(x.sum().item())

    with torch.device("meta"):
        model = ItemNet(4, 2)

    assert activation_bytes(model, (4,), rows=8) is None


def test_check_param_arrays_names_the_offender() -> None:
    expected = {"w": (2, 3), "b": (3,)}

    check_param_arrays({"w": torch.zeros(2, 3).numpy(), "b": torch.zeros(3).numpy()}, expected)
    with pytest.raises(ValueError, match=r"missing \['b'\], unknown \['c'\]"):
        check_param_arrays({"w": torch.zeros(2, 3).numpy(), "c": torch.zeros(3).numpy()}, expected)
    with pytest.raises(ValueError, match=r"'w': expected shape \(2, 3\), got \(3, 2\)"):
        check_param_arrays({"w": torch.zeros(3, 2).numpy(), "b": torch.zeros(3).numpy()}, expected)
