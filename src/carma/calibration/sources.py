"""The measurements calibration reads: Lucid's solo and pair profiles, GPUMemNet's utilization columns,
and the facts packaged with carma (analogues, datasets, thesis tables, constants)."""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

DATASETS_ENV = "CARMA_DATASETS"


class DataNotFound(FileNotFoundError):
    def __str__(self) -> str:
        return str(self.args[0])


def find_datasets(explicit: Path | None = None) -> Path:
    """The public-datasets folder (with lucid/ and gpumemnet/): --data, $CARMA_DATASETS, or a
    `shared/datasets` folder beside the working directory or the source checkout."""
    if explicit is not None:  # a folder the user named is the only one considered
        candidates = [explicit]
    elif os.environ.get(DATASETS_ENV):
        candidates = [Path(os.environ[DATASETS_ENV])]
    else:
        candidates = [
            parent / "shared" / "datasets"
            for base in (Path.cwd(), Path(__file__).resolve())
            for parent in (base, *base.parents)
        ]
    for path in candidates:
        if (path / "lucid" / "colocation_pairs.csv").is_file():
            return path
    where = explicit or (f"${DATASETS_ENV}" if os.environ.get(DATASETS_ENV) else "a shared/datasets folder")
    raise DataNotFound(
        f"calibration data not found in {where}: pass --data DIR, the folder holding lucid/ and gpumemnet/"
    )


def package_rows(name: str) -> list[dict[str, str]]:
    with (resources.files("carma.calibration") / "data" / name).open(newline="") as f:
        return list(csv.DictReader(f))


def constants() -> dict[str, float]:
    return {row["name"]: float(row["value"]) for row in package_rows("constants.csv")}


@dataclass(frozen=True)
class LucidJob:
    """One solo profile: throughput and nvidia-smi utilization (busy time, memory interface) as fractions."""

    model: str
    dataset: str
    batch: int
    amp: bool
    speed: float
    gract: float
    drama: float


@dataclass(frozen=True)
class LucidPair:
    first: LucidJob
    second: LucidJob
    speed_first: float  # collocated throughput relative to solo
    speed_second: float

    @property
    def group(self) -> str:
        """The unordered pair of models: the unit held out together when validating."""
        return " + ".join(sorted((self.first.model, self.second.model)))


def _key(model: str, dataset: str, batch: str, amp: str) -> tuple[str, str, int, bool]:
    return model, dataset, int(batch), amp == "1"


def load_lucid(root: Path) -> tuple[dict[tuple[str, str, int, bool], LucidJob], list[LucidPair]]:
    singles: dict[tuple[str, str, int, bool], LucidJob] = {}
    with open(root / "lucid" / "single_profiles.csv", newline="") as f:
        for row in csv.DictReader(f):
            key = _key(row["model"], row["dataset"], row["batchsize"], row["amp"])
            singles[key] = LucidJob(
                *key,
                speed=float(row["speed"]),
                gract=float(row["gpu_util"]) / 100,
                drama=float(row["gmem_util"]) / 100,
            )
    pairs = []
    with open(root / "lucid" / "colocation_pairs.csv", newline="") as f:
        for row in csv.DictReader(f):
            first = singles[_key(row["model1"], row["dataset1"], row["batchsize1"], row["amp1"])]
            second = singles[_key(row["model2"], row["dataset2"], row["batchsize2"], row["amp2"])]
            pairs.append(LucidPair(first, second, float(row["speed1"]), float(row["speed2"])))
    return singles, pairs


def load_gpumemnet_utilization(root: Path) -> tuple[list[float], list[float], list[float]]:
    """GPU utilization (GRACT, as a fraction), SMACT and SMOCC of each GPUMemNet training run."""
    gract, smact, smocc = [], [], []
    with open(root / "gpumemnet" / "mlp_training_runs.csv", newline="") as f:
        for row in csv.DictReader(f):
            gract.append(float(row["Avg GPUTL"]) / 100)
            smact.append(float(row["Avg SMACT"]))
            smocc.append(float(row["Avg SMOCC"]))
    return gract, smact, smocc
