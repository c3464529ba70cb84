"""The workload catalog: CARMA's training tasks with their measured time and memory and twin profiles."""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from carma.units import parse_mib

# xMem's are carma's own estimator's, recorded where docs/estimate.md measured it (CARMA's single-GPU CNN and
# BERT tasks); the others are the paper's
ESTIMATOR_COLUMNS = {
    "horus": "horus_mib",
    "faketensor": "faketensor_mib",
    "gpumemnet": "gpumemnet_mib",
    "xmem": "xmem_mib",
}
# where an experiment's memory needs come from: nothing (recovery only), the measured need, or an estimate; with
# HISTORY, a task the estimator has none for takes what the daemon's default estimator would give it (the peak of
# an earlier completed run of its workload, `carma.sim.hints.history_peak`)
HISTORY = "+history"
MEMORY_SOURCES = ("none", "oracle", *ESTIMATOR_COLUMNS, "xmem" + HISTORY)
PROFILE_FIELDS = ("gract", "smact", "smocc", "drama", "ttfk_s", "warmup_s", "mem_first_mib")
_FRACTIONS = ("gract", "smact", "smocc", "drama")
# The longest time a trace may give (about 317 years): a larger one is another unit's (milliseconds or
# nanoseconds since the epoch), and at 1e18 the twin's clock could tell times only 256 s apart.
LONGEST_S = 1e10
OVER_LONGEST = f"is over {LONGEST_S:g} s ({LONGEST_S / (365.25 * 86400):.0f} years): give it in seconds"


class UnknownTaskError(KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


@dataclass(frozen=True)
class Workload:
    """One training task as the twin models it; times in seconds, memory in MiB, utilization in [0, 1]."""

    name: str
    gpus: int
    solo_s: float  # exclusive execution time, start-up included
    mem_mib: int  # GPU memory it allocates on each of its GPUs, in the end
    gract: float  # share of time the GPU is busy with its kernels (nvidia-smi's "utilization")
    smact: float
    smocc: float
    drama: float
    ttfk_s: float  # launch to first sighting on the GPU (its CUDA context)
    warmup_s: float  # first sighting to its full allocation and full speed
    mem_first_mib: int  # memory at first sighting (context and weights)
    model: str = ""
    dataset: str = ""
    batch_size: int | None = None
    estimates: Mapping[str, int | None] = field(default_factory=dict)  # estimator name -> MiB or None

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise ValueError("gpus must be at least 1")
        if not (0 < self.solo_s < math.inf and self.mem_mib > 0):
            raise ValueError("solo time and memory must be positive and finite")
        if self.solo_s > LONGEST_S:
            raise ValueError(f"solo time {self.solo_s:g} s {OVER_LONGEST}")
        if self.ttfk_s < 0 or self.warmup_s < 0 or self.ttfk_s + self.warmup_s >= self.solo_s:
            raise ValueError(
                f"time to first kernel ({self.ttfk_s:g} s) and warm-up ({self.warmup_s:g} s) must be "
                f"non-negative and end before the solo time ({self.solo_s:g} s)"
            )
        if not 0 <= self.mem_first_mib <= self.mem_mib:
            raise ValueError(f"memory at first sighting must lie between 0 and the need ({self.mem_mib} MiB)")
        for metric in _FRACTIONS:
            if not 0.0 <= getattr(self, metric) <= 1.0:
                raise ValueError(f"{metric} must be a fraction in [0, 1]")


class Catalog(Mapping[str, Workload]):
    def __init__(self, workloads: Mapping[str, Workload]) -> None:
        self._workloads = dict(workloads)

    def __getitem__(self, name: str) -> Workload:
        try:
            return self._workloads[name]
        except KeyError:
            raise UnknownTaskError(f"unknown task {name!r}: it is not in the workload catalog") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._workloads)

    def __len__(self) -> int:
        return len(self._workloads)

    def with_workloads(self, extra: Mapping[str, Workload]) -> Catalog:
        return Catalog({**self._workloads, **extra})

    def typical_profile(self) -> dict[str, float]:
        """Median profile of the catalog: the twin's default for a workload that gives none."""
        return {f: statistics.median(getattr(w, f) for w in self.values()) for f in PROFILE_FIELDS}


def _optional_int(text: str) -> int | None:
    return int(float(text)) if text.strip() else None


def data_file(name: str) -> Path:
    return Path(str(resources.files("carma.traces") / "data" / name))


def load_catalog(workloads_csv: Path | None = None, profiles_csv: Path | None = None) -> Catalog:
    """Join the workload table with the twin's per-task profiles (both packaged by default)."""
    workloads_csv = workloads_csv or data_file("workloads.csv")
    profiles_csv = profiles_csv or data_file("profiles.csv")
    with open(profiles_csv, newline="") as f:
        profiles = {row["task"]: row for row in csv.DictReader(f)}
    workloads: dict[str, Workload] = {}
    with open(workloads_csv, newline="") as f:
        for row in csv.DictReader(f):
            name = row["task"]
            if name not in profiles:
                raise ValueError(f"{profiles_csv}: no profile for task {name!r}")
            prof = profiles[name]
            workloads[name] = Workload(
                name=name,
                gpus=int(row["gpus"]),
                solo_s=float(row["solo_minutes"]) * 60.0,
                mem_mib=int(row["mem_mib"]),
                **{f: float(prof[f]) for f in PROFILE_FIELDS if f != "mem_first_mib"},
                mem_first_mib=int(prof["mem_first_mib"]),
                model=row["model"],
                dataset=row["dataset"],
                batch_size=int(row["batch_size"]),
                estimates={est: _optional_int(row.get(col) or "") for est, col in ESTIMATOR_COLUMNS.items()},
            )
    return Catalog(workloads)


def _whole(value: object) -> int:
    number = float(value)
    if not number.is_integer():
        raise ValueError(f"not a whole number: {value!r}")
    return int(number)


def _finite(value: object) -> float:
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"not a finite number: {value!r}")
    return number


FIELD_PARSERS: dict[str, Callable[[Any], Any]] = {
    "gpus": _whole,
    "solo_s": _finite,
    "mem_mib": parse_mib,
    **dict.fromkeys(PROFILE_FIELDS, _finite),
    "mem_first_mib": parse_mib,
    **dict.fromkeys(ESTIMATOR_COLUMNS.values(), parse_mib),  # what an estimator said: `--memory horus` etc.
}


def _parse_field(key: str, value: object) -> object:
    kind = "a whole number" if key == "gpus" else "a finite number"
    if isinstance(value, bool):
        raise ValueError(f"{key} must be {kind}, not {value!r}")
    try:
        return FIELD_PARSERS[key](value)
    except (TypeError, ValueError) as err:
        if FIELD_PARSERS[key] is parse_mib:  # a memory size: its own message says what is wrong with it
            raise ValueError(f"{key}: {err}") from None
        raise ValueError(f"{key} must be {kind}, not {value!r}") from err


def define_workload(
    name: str, fields: Mapping[str, object], catalog: Catalog, defined: Workload | None = None
) -> Workload:
    """A workload from user-given fields (as text or numbers): overrides of a catalog task or of one the
    trace `defined` above, or a new task.

    A new task must give `solo_s` and `mem_mib`; profile fields it leaves out take the catalog's typical
    (median) profile. Errors name the task once.
    """
    if not fields:
        return defined or catalog[name]
    unknown = set(fields) - set(FIELD_PARSERS)
    try:
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")
        parsed = {key: _parse_field(key, value) for key, value in fields.items()}
        if defined is not None or name in catalog:
            base = asdict(defined or catalog[name])
        else:
            missing = [f for f in ("solo_s", "mem_mib") if f not in parsed]
            if missing:
                raise UnknownTaskError(
                    f"unknown task {name!r}: not in the workload catalog; define it with {' and '.join(missing)}"
                )
            base = {"name": name, "gpus": 1, **catalog.typical_profile()}
        estimates = {est: parsed.pop(col) for est, col in ESTIMATOR_COLUMNS.items() if col in parsed}
        merged = {**base, **parsed, "estimates": {**base.get("estimates", {}), **estimates}}
        if "mem_first_mib" not in parsed:  # what shows first cannot exceed the (given) need
            merged["mem_first_mib"] = min(int(merged["mem_first_mib"]), int(merged["mem_mib"]))
        start_s = float(merged["ttfk_s"]) + float(merged["warmup_s"])
        if not {"ttfk_s", "warmup_s"} & set(parsed) and 0 < float(merged["solo_s"]) <= start_s:
            raise ValueError(  # values the user never wrote: say whose they are and what to give
                f"a task of {merged['solo_s']:g} s needs its own ttfk_s and warmup_s: the catalog's "
                f"({merged['ttfk_s']:g} s and {merged['warmup_s']:g} s) do not end before it"
            )
        return Workload(**merged)
    except UnknownTaskError:
        raise
    except ValueError as err:
        raise ValueError(f"task {name!r}: {err}") from None
