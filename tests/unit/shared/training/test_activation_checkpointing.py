"""Activation checkpointing of a model's blocks: same results, same names, blocks found."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shared.training.activation_checkpointing import checkpoint_blocks, find_blocks, model_blocks
from shared.training.models import ModelError
from tests.fixtures.models import block_mlp, bn_hidden_mlp


def _grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("factory", [block_mlp, bn_hidden_mlp], ids=["blocks", "sequential"])
def test_checkpointed_blocks_give_the_plain_models_loss_and_gradients(factory) -> None:
    # Arrange: two copies of the same seeded model, one checkpointed.
    torch.manual_seed(0)
    plain = factory()
    ac = factory()
    ac.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
    # Act
    n = checkpoint_blocks(ac)
    want, got = _grads(plain, x, y), _grads(ac, x, y)
    # Assert: every block checkpointed, same names, gradients within 1e-5 (in fact equal).
    assert n == len(find_blocks(ac)) > 0
    assert list(ac.state_dict()) == list(plain.state_dict())
    assert set(got) == set(want)
    for name, grad in want.items():
        assert float((got[name] - grad).abs().max()) < 1e-5, name


def test_checkpointed_blocks_recompute_their_forward_in_backward() -> None:
    model = block_mlp()
    checkpoint_blocks(model)
    calls = []
    # The block's first layer (torch stops recomputing once every saved tensor is back, so
    # hooks at the block's end may not run again).
    model.blocks[0].inner[0].register_forward_hook(lambda *_: calls.append(1))
    out = model(torch.randn(4, 64))
    assert len(calls) == 1
    out.sum().backward()
    assert len(calls) == 2  # the block ran again to rebuild its activations
    with torch.no_grad():
        model(torch.randn(4, 64))
    assert len(calls) == 3  # no recomputation without gradients


def test_blocks_are_the_blocks_attribute_or_a_sequentials_children() -> None:
    assert len(find_blocks(block_mlp(depth=4))) == 4
    assert len(find_blocks(bn_hidden_mlp())) == 5
    assert find_blocks(nn.Linear(2, 2)) == []


def test_a_model_without_blocks_is_refused_by_name() -> None:
    with pytest.raises(ModelError, match="model: Linear exposes no blocks"):
        model_blocks(nn.Linear(2, 2))
    with pytest.raises(ModelError, match="exposes no blocks"):
        model_blocks(nn.Sequential())
