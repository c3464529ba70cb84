"""U-Net with a ResNet-34 encoder as segmentation_models_pytorch's `Unet("resnet34", classes=21)` defines it
(24,439,269 parameters; its releases 0.4 to 0.6), the model of CARMA's UNet task: torchvision's ResNet-34 up
to its last stage as the encoder, five decoder blocks (nearest upsampling to the next skip's size, the skip
concatenated, two 3x3 convolutions with batch norm and ReLU), a 3x3 convolution to the classes as the head.
Written here rather than installed: the library pulls timm and the Hugging Face hub for one architecture."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

DECODER = (256, 128, 64, 32, 16)  # the decoder blocks' channels, deepest first


def conv_bn_relu(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class DecoderBlock(nn.Module):
    def __init__(self, cin: int, skip: int, cout: int) -> None:
        super().__init__()
        self.conv1 = conv_bn_relu(cin + skip, cout)
        self.conv2 = conv_bn_relu(cout, cout)

    def forward(self, x: torch.Tensor, size: torch.Size, skip: torch.Tensor | None) -> torch.Tensor:
        x = F.interpolate(x, size=size, mode="nearest")
        if skip is not None:
            x = torch.cat([x, skip], dim=1)
        return self.conv2(self.conv1(x))


class Unet(nn.Module):
    def __init__(self, models, classes: int) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        resnet = models.resnet34(weights=None)
        del resnet.fc, resnet.avgpool  # the encoder ends at its last stage
        self.encoder = resnet
        skips = (256, 128, 64, 64, 0)  # layer3, layer2, layer1, the stem's output, none at full size
        inputs = (512, *DECODER[:-1])
        self.blocks = nn.ModuleList(DecoderBlock(i, s, o) for i, s, o in zip(inputs, skips, DECODER, strict=True))
        self.head = nn.Conv2d(DECODER[-1], classes, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.encoder
        stem = e.relu(e.bn1(e.conv1(x)))
        l1 = e.layer1(e.maxpool(stem))
        l2 = e.layer2(l1)
        l3 = e.layer3(l2)
        y = e.layer4(l3)
        sizes = (l3.shape[2:], l2.shape[2:], l1.shape[2:], stem.shape[2:], x.shape[2:])
        for block, size, skip in zip(self.blocks, sizes, (l3, l2, l1, stem, None), strict=True):
            y = block(y, size, skip)
        return self.head(y)
