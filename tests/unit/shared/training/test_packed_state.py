"""``packed_state``: a state dict through bytes and back, bit for bit; bytes that do not fit."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from shared.training.packed_state import PackedStateError, is_packed, load_packed, pack_state


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model(torch.randn(5, 3))  # running statistics and num_batches_tracked (int64) move
    return model


def test_a_packed_state_loads_into_another_model_bit_for_bit() -> None:
    # Arrange
    source, target = _model(0), _model(1)

    # Act
    data = pack_state(source.state_dict())
    load_packed(target, data)

    # Assert: every parameter and buffer, dtypes included
    assert is_packed(data)
    got, want = target.state_dict(), source.state_dict()
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype
        assert torch.equal(got[name], tensor), name


def test_torch_save_bytes_are_not_packed() -> None:
    buf = io.BytesIO()
    torch.save(_model(0).state_dict(), buf)

    assert not is_packed(buf.getvalue())
    with pytest.raises(PackedStateError, match="not a packed state"):
        load_packed(_model(0), buf.getvalue())


def test_bytes_that_do_not_fit_the_model_are_refused() -> None:
    model = _model(0)
    data = pack_state(model.state_dict())
    other = pack_state(nn.Linear(3, 4).state_dict())

    with pytest.raises(PackedStateError, match="does not parse"):
        load_packed(model, data[:-4])
    with pytest.raises(PackedStateError, match="does not fit the model"):
        load_packed(model, other)
    with pytest.raises(PackedStateError, match="does not parse"):
        load_packed(model, (3).to_bytes(8, "little") + b"{{{")
    with pytest.raises(PackedStateError, match="does not parse"):  # a header naming 2**40 bytes
        load_packed(model, (2**40).to_bytes(8, "little") + b"{}")


def test_tied_weights_pack_and_load() -> None:
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight  # tied, as the GPT example's head and embedding
    target = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    target[1].weight = target[0].weight

    load_packed(target, pack_state(model.state_dict()))

    assert torch.equal(target[0].weight, model[0].weight)
    assert target[1].weight is target[0].weight
