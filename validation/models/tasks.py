"""CARMA's workload tasks (shared/datasets/carma/workloads.csv) as commands of the scripts beside this file.

Covered: the single-GPU CNN tasks (torchvision architectures, Xception as timm defines it), the BERT tasks,
UNet (segmentation_models_pytorch's U-Net as `unet.py` defines it) and the two-GPU tasks (gpt2_large_2 under
DataParallel, the XLNet ones under Hugging Face's Trainer), whose `mem_mib` is taken as the first GPU's, the
most either holds. Not covered: DLRM and Mask R-CNN (CARMA ran them from other repositories' scripts). DLRM's
command names no `--max-ind-range`, so its embedding tables are Criteo Terabyte's full ones (hundreds of
GiB at 64 floats a row): what its 1,468 MiB measured cannot be rebuilt. Mask R-CNN's proposals are shaped
by values (non-maximum suppression, which the CPU torchvision here has no kernel for), so its capture
computes every value and holds about the job's 28 GiB in host memory, more than the 23 GiB of the machine
this set was run on. Rows that repeat a model, dataset and batch size (the
20- and 50-epoch CIFAR tasks) are one task, named by its first row.
"""

from __future__ import annotations

import csv
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
LANGUAGE = ("bert_base", "bert_large")
CAUSAL = ("gpt2_large",)
CLASSIFICATION = ("xlnet_base", "xlnet_large")
SEGMENTATION = ("unet",)
VISION = (
    "inception_v3", "xception", "efficientnet_b0", "mobilenet_v2", "mobilenet_v3_small", "resnet18", "resnet34",
    "resnet50", "vgg16",
)  # fmt: skip


@dataclass(frozen=True)
class Task:
    name: str
    model: str
    dataset: str
    batch_size: int
    mem_mib: int  # CARMA's measured peak on an A100-40GB, context included
    gpus: int = 1

    @property
    def family(self) -> str:
        return "transformer" if self.model in (*LANGUAGE, *CAUSAL, *CLASSIFICATION) else "CNN"

    def argv(self, python: str = sys.executable) -> list[str]:
        if self.model in LANGUAGE:
            return [python, str(HERE / "language.py"), self.model, "--batch-size", str(self.batch_size)]
        if self.model in CAUSAL:
            return [python, str(HERE / "gpt2.py"), "--batch-size", str(self.batch_size)]
        if self.model in CLASSIFICATION:
            return [python, str(HERE / "xlnet.py"), self.model, "--batch-size", str(self.batch_size)]
        if self.model in SEGMENTATION:
            return [python, str(HERE / "segmentation.py"), "--batch-size", str(self.batch_size)]
        script = str(HERE / "vision.py")
        return [python, script, self.model, "--dataset", self.dataset, "--batch-size", str(self.batch_size)]


def load(workloads_csv: Path) -> list[Task]:
    """The covered tasks of CARMA's table, each (model, dataset, batch size) once, in the table's order."""
    tasks: dict[tuple[str, str, int], Task] = {}
    with workloads_csv.open(newline="") as f:
        for row in csv.DictReader(f):
            if row["model"] not in (*LANGUAGE, *CAUSAL, *CLASSIFICATION, *VISION, *SEGMENTATION):
                continue
            size, mib, gpus = int(row["batch_size"]), int(row["mem_mib"]), int(row["gpus"])
            task = Task(row["task"], row["model"], row["dataset"], size, mib, gpus)
            tasks.setdefault((task.model, task.dataset, task.batch_size), task)
    return list(tasks.values())
