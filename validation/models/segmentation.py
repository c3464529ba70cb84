"""CARMA's UNet task (itu-rad/CARMA workloads/UNet.py), on random images of PASCAL VOC's shape.

    python validation/models/segmentation.py --batch-size 8

As CARMA trained it, less the data loading: segmentation_models_pytorch's U-Net with a ResNet-34 encoder
(`unet.py`) on VOC 2012 resized to 512x512 (1,464 training and 1,449 validation images, 21 classes), AdamW
(lr 1e-3), the library's multiclass Dice loss (below), without mixed precision (the script's default); a
validation pass after each epoch that, as there, runs the model in eval mode without `no_grad`, and the
model summary (torchinfo's: one forward pass of a batch under `no_grad`) before training. Nothing is
downloaded: no weights, no data.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchvision_ops import import_models
from unet import Unet

TRAIN, VAL, SIDE, CLASSES = 1_464, 1_449, 512, 21


class RandomMasks(Dataset):
    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.rand(3, SIDE, SIDE), torch.randint(0, CLASSES, (SIDE, SIDE))


class DiceLoss(nn.Module):
    """segmentation_models_pytorch's `DiceLoss(mode="multiclass")` (0.4 to 0.6), the same operations: softmax
    probabilities through log-softmax, one-hot targets, per class the overlap from the sums and the L1
    distance, classes absent from the batch left out of the mean."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        batch, classes = logits.shape[:2]
        probs = logits.log_softmax(dim=1).exp().reshape(batch, classes, -1)
        truth = nn.functional.one_hot(target.reshape(batch, -1), classes).permute(0, 2, 1).type_as(probs)
        probs_sum, truth_sum = probs.sum(dim=(0, 2)), truth.sum(dim=(0, 2))
        distance = torch.linalg.vector_norm(probs - truth, ord=1, dim=(0, 2))
        overlap = (probs_sum + truth_sum - distance) / 2
        score = overlap / (overlap + 0.5 * (probs_sum - overlap) + 0.5 * (truth_sum - overlap)).clamp_min(1e-7)
        loss = (1.0 - score) * (truth_sum > 0).to(score.dtype)
        return loss.mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=90)  # CARMA's
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = Unet(import_models(), CLASSES).to(device)
    with torch.no_grad():  # the model summary's forward pass
        model(torch.rand(args.batch_size, 3, SIDE, SIDE, device=device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    criterion = DiceLoss()
    loaders = {
        train: DataLoader(RandomMasks(length), batch_size=args.batch_size, shuffle=train)
        for train, length in ((True, TRAIN), (False, VAL))
    }
    for _ in range(args.epochs):
        for train, loader in loaders.items():
            model.train(train)
            total = 0.0
            for images, masks in loader:
                images, masks = images.to(device), masks.to(device)
                loss = criterion(model(images), masks)
                if train:
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                total += loss.item() * images.size(0)


if __name__ == "__main__":
    main()
