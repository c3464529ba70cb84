"""Xception (Chollet, 2017) as timm's `xception` defines it (22.9M parameters for 1,000 classes), which
torchvision lacks: entry flow, eight middle-flow blocks, exit flow, separable convolutions throughout."""

from __future__ import annotations

from torch import nn


class SeparableConv2d(nn.Sequential):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__(nn.Conv2d(cin, cin, 3, 1, 1, groups=cin, bias=False), nn.Conv2d(cin, cout, 1, bias=False))


class Block(nn.Module):
    def __init__(self, cin: int, cout: int, reps: int, stride: int, start_relu: bool = True, grow_first: bool = True):
        super().__init__()
        self.skip = None
        if cout != cin or stride != 1:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        layers: list[nn.Module] = []
        channels = [cin] + [cout if grow_first else cin] * (reps - 1) + [cout]
        for i in range(reps):
            layers += [nn.ReLU(inplace=i > 0 or not start_relu), SeparableConv2d(channels[i], channels[i + 1])]
            layers.append(nn.BatchNorm2d(channels[i + 1]))
        if not start_relu:
            layers = layers[1:]
        if stride != 1:
            layers.append(nn.MaxPool2d(3, stride, 1))
        self.rep = nn.Sequential(*layers)

    def forward(self, x):
        return self.rep(x) + (x if self.skip is None else self.skip(x))


def xception(classes: int = 1000) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, 2, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
        nn.Conv2d(32, 64, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
        Block(64, 128, 2, 2, start_relu=False), Block(128, 256, 2, 2), Block(256, 728, 2, 2),
        *(Block(728, 728, 3, 1) for _ in range(8)),
        Block(728, 1024, 2, 2, grow_first=False),
        SeparableConv2d(1024, 1536), nn.BatchNorm2d(1536), nn.ReLU(inplace=True),
        SeparableConv2d(1536, 2048), nn.BatchNorm2d(2048), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, classes),
    )  # fmt: skip
