"""The measurements calibration reads: Lucid's solo and pair profiles, GPUMemNet's utilization columns,
and the facts packaged with carma (analogues, datasets, thesis tables, constants)."""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

DATASETS_ENV = "CARMA_DATASETS"


class DataNotFound(FileNotFoundError):
    def __str__(self) -> str:
        return str(self.args[0])


LUCID_PAIRS = "lucid/colocation_pairs.csv"
GPUMEMNET_RUNS = "gpumemnet/mlp_training_runs.csv"  # the estimator scripts' only file


def find_datasets(explicit: Path | None = None, needs: str = LUCID_PAIRS) -> Path:
    """The public-datasets folder (with lucid/ and gpumemnet/), the first that holds the file `needs`: --data,
    $CARMA_DATASETS, or a `shared/datasets` folder beside the working directory or the source checkout."""
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
        if (path / needs).is_file():
            return path
    named = os.environ.get(DATASETS_ENV)
    where = explicit or (f"${DATASETS_ENV} ({named})" if named else "a shared/datasets folder")
    raise DataNotFound(
        f"{'calibration data' if needs == LUCID_PAIRS else needs} not found in {where}: pass --data DIR or set "
        f"${DATASETS_ENV} to the folder holding lucid/ and gpumemnet/"
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
    if amp not in ("0", "1"):
        raise ValueError(f"amp is {amp!r}, not 0 or 1")
    return model, dataset, int(batch), amp == "1"


def _number(row: dict[str, str], column: str, share_of: float | None = None) -> float:
    """A finite number; with `share_of`, a share from 0 to it (a percentage: 100, a fraction: 1)."""
    value = float(row[column])
    if not math.isfinite(value):
        raise ValueError(f"{column} is {row[column]!r}")
    if share_of is not None and not 0 <= value <= share_of:
        raise ValueError(f"{column} is {row[column]}, not from 0 to {share_of:g}")
    return value


def _throughput(row: dict[str, str], column: str) -> float:
    """A throughput, solo or relative to solo: more than 0 (a fit divides by it; a negative one was written into
    the profiles, which every simulation then refused)."""
    value = _number(row, column)
    if value <= 0:
        raise ValueError(f"{column} is {row[column]}: a throughput is more than 0")
    return value


def _read(path: Path, columns: tuple[str, ...], convert: Callable[[dict[str, str]], T]) -> list[T]:
    """Each row of a measurement file, converted. A missing column, a row of too few or too many values, a
    value that is not a number or a file without rows is a one-line error naming the file: a fit on nothing
    would write parameters from no data."""
    with open(path, newline="", encoding="utf-8-sig") as f:  # a spreadsheet's byte-order mark is not a column's
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or ())]
        if missing:
            raise ValueError(f"{path}: no column {', '.join(map(repr, missing))}")
        rows = []
        for row in reader:
            try:
                if None in row.values() or None in row:  # a row cut short (a truncated copy) or one too long
                    raise ValueError("not as many values as the header has columns")
                rows.append(convert(row))
            except ValueError as e:
                raise ValueError(f"{path}, line {reader.line_num}: {e}") from None
    if not rows:
        raise ValueError(f"{path}: no measurements in it")
    return rows


SINGLE_COLUMNS = ("model", "dataset", "batchsize", "amp", "speed", "gpu_util", "gmem_util")
PAIR_COLUMNS = tuple(f"{c}{n}" for n in (1, 2) for c in ("model", "dataset", "batchsize", "amp", "speed"))
UTILIZATION_COLUMNS = ("Avg GPUTL", "Avg SMACT", "Avg SMOCC")


def load_lucid(root: Path) -> tuple[dict[tuple[str, str, int, bool], LucidJob], list[LucidPair]]:
    def single(row: dict[str, str]) -> LucidJob:
        key = _key(row["model"], row["dataset"], row["batchsize"], row["amp"])
        return LucidJob(
            *key,
            speed=_throughput(row, "speed"),
            gract=_number(row, "gpu_util", 100) / 100,
            drama=_number(row, "gmem_util", 100) / 100,
        )

    jobs = _read(root / "lucid" / "single_profiles.csv", SINGLE_COLUMNS, single)
    singles = {(j.model, j.dataset, j.batch, j.amp): j for j in jobs}

    def job(row: dict[str, str], n: int) -> LucidJob:
        key = _key(row[f"model{n}"], row[f"dataset{n}"], row[f"batchsize{n}"], row[f"amp{n}"])
        if key not in singles:
            raise ValueError(f"no solo profile of {key[0]} on {key[1]}, batch {key[2]}, amp {int(key[3])}")
        return singles[key]

    def pair(row: dict[str, str]) -> LucidPair:
        return LucidPair(job(row, 1), job(row, 2), _throughput(row, "speed1"), _throughput(row, "speed2"))

    return singles, _read(root / "lucid" / "colocation_pairs.csv", PAIR_COLUMNS, pair)


def load_gpumemnet_utilization(root: Path) -> tuple[list[float], list[float], list[float]]:
    """GPU utilization (GRACT, as a fraction), SMACT and SMOCC of each GPUMemNet training run."""
    rows = _read(
        root / "gpumemnet" / "mlp_training_runs.csv",
        UTILIZATION_COLUMNS,
        lambda r: (_number(r, "Avg GPUTL", 100) / 100, _number(r, "Avg SMACT", 1), _number(r, "Avg SMOCC", 1)),
    )
    gract, smact, smocc = (list(column) for column in zip(*rows, strict=True))
    return gract, smact, smocc
