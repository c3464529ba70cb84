"""A CARMA CNN task (itu-rad/CARMA workloads/*.py), on random images of the dataset's shape.

    python validation/models/vision.py resnet50 --dataset imagenet --batch-size 32
    python validation/models/vision.py resnet18 --dataset cifar100 --batch-size 64

As CARMA trained them, less the data loading: ImageNet tasks (224x224, Inception's 299x299; 1,000 classes)
with Adam (lr 1e-3); CIFAR-100 tasks (32x32, 100 classes; CARMA built them with timm, here torchvision's
definitions of the same architectures) with AdamW (lr 1e-3, weight decay 1e-4) and a cosine schedule;
cross-entropy, `zero_grad()` before each forward, the loss read with `.item()` every step. The images are
drawn per sample by the dataset, whose length is the real one, so each epoch ends with the real short batch.
Nothing is downloaded: no weights (`weights=None`), no data.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchvision_ops import import_models
from xception import xception

DATASETS = {  # images, side, classes
    "imagenet": (1_281_167, 224, 1000),
    "cifar100": (50_000, 32, 100),
}
SIDE = {"inception_v3": 299}  # CARMA's Inception resized to 299x299
OPTIONS = {"inception_v3": {"aux_logits": False, "init_weights": True}}


class RandomImages(Dataset):
    def __init__(self, length: int, side: int, classes: int) -> None:
        self.length, self.side, self.classes = length, side, classes

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.randn(3, self.side, self.side), i % self.classes


def build(name: str, classes: int) -> nn.Module:
    if name == "xception":  # timm's, which torchvision lacks
        return xception(classes)
    return getattr(import_models(), name)(weights=None, num_classes=classes, **OPTIONS.get(name, {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dataset", choices=DATASETS, default="imagenet")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    length, side, classes = DATASETS[args.dataset]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build(args.model, classes).to(device)
    data = RandomImages(length, SIDE.get(args.model, side), classes)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    criterion = nn.CrossEntropyLoss()
    if args.dataset == "cifar100":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=10)
    for _ in range(args.epochs):
        model.train()
        running = 0.0
        for inputs, labels in loader:
            inputs, labels = inputs.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = criterion(model(inputs), labels)
            loss.backward()
            optimizer.step()
            running += loss.item()
        if args.dataset == "cifar100":
            scheduler.step()


if __name__ == "__main__":
    main()
