"""ResNet-18 (He et al. 2016, table 1), written here: torchvision does not run on our CPU torch.

He et al. 2016, "Deep Residual Learning for Image Recognition".

torchvision 0.28.0 is the release for torch 2.13.0 (it requires ``torch==2.13.0``), but the
only wheel PyPI has for Linux x86_64 is the CUDA build: its ``_C.so`` links
``libtorch_cuda.so`` and ``libc10_cuda.so``, which the CPU wheel ``torch==2.13.0+cpu`` does
not ship, so ``import torchvision`` fails with "operator torchvision::nms does not exist"
(the CPU build of torchvision is on PyTorch's own index only, which this project does not
reach). This module is the same network as ``torchvision.models.resnet18(num_classes=...)``:
the same modules, parameter and buffer names and shapes (a state dict of one loads into the
other) and the same initialisation rule (Kaiming-normal convolutions, fan-out, ReLU gain; He
et al. 2015; BatchNorm weight 1, bias 0; the head as ``nn.Linear``'s default).

The stem is ImageNet's (7x7 stride-2 convolution, 3x3 stride-2 max-pool), as torchvision's:
a 32x32 image is 8x8 after the stem and 1x1 after ``layer4``.

Shapes: B images, C channels, H x W pixels.
"""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm, added to a shortcut of the input.

    ``relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))``; the shortcut is a strided 1x1
    convolution and BatchNorm when the shape changes (the paper's option B), else the identity.
    """

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample: nn.Module | None = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        """[B, C_in, H, W] float32 -> [B, planes, H / stride, W / stride]."""
        out = self.relu(self.bn1(self.conv1(x_BCHW)))
        out = self.bn2(self.conv2(out))
        shortcut = x_BCHW if self.downsample is None else self.downsample(x_BCHW)
        y: torch.Tensor = self.relu(out + shortcut)
        return y


class ResNet18(nn.Module):
    """Images [B, 3, H, W] float32 -> class logits [B, num_classes] float32."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.layer1 = nn.Sequential(BasicBlock(64, 64), BasicBlock(64, 64))
        self.layer2 = nn.Sequential(BasicBlock(64, 128, 2), BasicBlock(128, 128))
        self.layer3 = nn.Sequential(BasicBlock(128, 256, 2), BasicBlock(256, 256))
        self.layer4 = nn.Sequential(BasicBlock(256, 512, 2), BasicBlock(512, 512))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] float32 images -> [B, num_classes] float32 logits."""
        x = self.maxpool(self.relu(self.bn1(self.conv1(x_BCHW))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        logits: torch.Tensor = self.fc(torch.flatten(self.avgpool(x), 1))
        return logits


def resnet18(num_classes: int = 10) -> nn.Module:
    """ResNet-18 (the entry point ``examples.resnet:resnet18``), torchvision's network.

    Args:
        num_classes: width of the head, the number of classes C.

    Returns:
        A ``ResNet18`` mapping [B, 3, H, W] float32 images to [B, C] logits (11.2M parameters
        at C = 10); 20 BatchNorm2d layers, which ``sync_batchnorm: true`` makes global.
    """
    return ResNet18(num_classes)
