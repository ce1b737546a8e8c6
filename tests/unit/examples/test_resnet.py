"""examples.resnet: torchvision 0.28.0's resnet18(num_classes=10), pinned by values it gives.

The literals were taken from ``torchvision.models.resnet18(num_classes=10)`` of torchvision
0.28.0 (torch 2.13.0): its parameter count, its state dict's first and last names, and, after
``torch.manual_seed(0)`` (its constructor is the only consumer of the RNG), sums of two of its
initial weights and its eval-mode logits for a seeded input. Equal values mean the same
modules, created in the same order, with the same initialisation.
"""

from __future__ import annotations

import pytest
import torch

from examples.resnet import resnet18

TORCHVISION_PARAMS = 11_181_642
TORCHVISION_STATE_ENTRIES = 122
TORCHVISION_CONV1_SUM = -0.6737563014030457
TORCHVISION_FC_SUM = 0.8813121318817139
TORCHVISION_LOGITS_ROW0 = [
    0.04346871003508568,
    0.012081144377589226,
    -0.09993398189544678,
    0.05125933885574341,
    -0.23387259244918823,
    -0.3304275870323181,
    0.05191822722554207,
    0.023089157417416573,
    0.08447697758674622,
    0.09921538084745407,
]


def test_resnet18_is_torchvisions_network_with_its_initialisation() -> None:
    torch.manual_seed(0)
    model = resnet18(num_classes=10).eval()
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))

    with torch.no_grad():
        logits = model(x)

    state = model.state_dict()
    assert sum(p.numel() for p in model.parameters()) == TORCHVISION_PARAMS
    assert len(state) == TORCHVISION_STATE_ENTRIES
    assert (list(state)[0], list(state)[-1]) == ("conv1.weight", "fc.bias")
    assert "layer2.0.downsample.1.running_var" in state
    assert float(state["conv1.weight"].sum()) == pytest.approx(TORCHVISION_CONV1_SUM, rel=1e-5)
    assert float(state["fc.weight"].sum()) == pytest.approx(TORCHVISION_FC_SUM, rel=1e-5)
    torch.testing.assert_close(logits[0], torch.tensor(TORCHVISION_LOGITS_ROW0))
