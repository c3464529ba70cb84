"""`carma twin calibrate`: fit every twin model on the measurements and write what the twin ships with."""

from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carma.calibration.interference import fit_timeslice, mps_share, pair_points
from carma.calibration.power import fit_exponent, measured_ratios
from carma.calibration.profiles import FIELDS, build_profiles, busy_fraction, drama_share, nearest_job
from carma.calibration.sources import constants, load_gpumemnet_utilization, load_lucid, package_rows
from carma.calibration.utilization import UtilizationRelation, fit_relation
from carma.sim.gpus import GPU_TYPES
from carma.sim.models import InterferenceModel, Load, PowerModel
from carma.traces.catalog import data_file

ENERGY_GPU = GPU_TYPES["a100-40gb"]  # the thesis measured on a DGX Station A100 (A100-40GB)


@dataclass(frozen=True)
class Calibration:
    relation: UtilizationRelation
    timeslice: tuple[float, float, float]
    mps_share: float
    power_exponent: float
    small_workload: Load  # ResNet26/CIFAR-10, batch 32: the thesis's energy-table workload
    profiles: list[dict[str, object]]
    pairs: int
    pair_points: int
    pairings: int

    @property
    def interference(self) -> InterferenceModel:
        return InterferenceModel(*self.timeslice, mps_share=self.mps_share)

    @property
    def power(self) -> PowerModel:
        return PowerModel(exponent=self.power_exponent)

    def params(self) -> dict[str, Any]:
        a, p, q = self.timeslice
        rel = self.relation
        return {
            "timeslice": {
                "a": round(a, 4),
                "p": round(p, 4),
                "q": round(q, 4),
                "fitted_on": (
                    f"Lucid colocation_pairs.csv: {self.pairs} pairs ({self.pair_points} speeds, "
                    f"{self.pairings} model pairings), least absolute error"
                ),
            },
            "mps": {
                "share": round(self.mps_share, 4),
                "source": "thesis Table 4.4, DLRM + ResNet152: MPS adds 4%/4%, naive sharing 14%/5%",
            },
            "power": {
                "exponent": round(self.power_exponent, 4),
                "fitted_on": "thesis Table 4.2 (ResNet26/CIFAR-10, batch 32): energy of 2X, 3X, 7X MPS relative to 1X",
                "idle_and_max": "per GPU type in carma.sim.gpus (datasheet board power; idle a first constant)",
            },
            "utilization": {
                "smact_slope": round(rel.slope, 4),
                "smact_offset": round(rel.offset, 4),
                "smocc_scale": round(rel.smocc_scale, 4),
                "smocc_power": round(rel.smocc_power, 4),
                "fitted_on": f"GPUMemNet mlp_training_runs.csv: {rel.runs} runs (Avg GPUTL, SMACT, SMOCC)",
            },
        }


def small_workload(singles, relation: UtilizationRelation, consts: dict[str, float]) -> Load:
    """ResNet26/CIFAR-10 at batch 32 by the profile rule: Lucid's ResNet-18 on CIFAR-10 at batch 32, run at
    the same throughput (CARMA's ResNet-18/CIFAR epoch times equal Lucid's speeds), scaled by FLOPs."""
    job = nearest_job(singles, "ResNet18", "CIFAR-10", 32)
    gract = busy_fraction(job.speed, job, consts["resnet26_flops_ratio"], consts["a100_speedup_over_lucid_gpu"])
    smact = relation.smact(gract)
    return Load(gract, smact, relation.smocc(smact), drama_share(gract, job))


def calibrate(data: Path) -> Calibration:
    singles, pairs = load_lucid(data)
    consts = constants()
    relation = fit_relation(*load_gpumemnet_utilization(data))
    points = pair_points(pairs)
    timeslice = fit_timeslice(points)
    share = mps_share(package_rows("thesis_pair.csv"))
    load = small_workload(singles, relation, consts)
    model = InterferenceModel(*timeslice, mps_share=share)
    exponent = fit_exponent(model, ENERGY_GPU, load, measured_ratios(package_rows("thesis_energy.csv")))
    with open(data_file("workloads.csv"), newline="") as f:
        workloads = list(csv.DictReader(f))
    profiles = build_profiles(
        workloads, package_rows("analogues.csv"), package_rows("datasets.csv"), singles, relation, consts
    )
    return Calibration(
        relation, timeslice, share, exponent, load, profiles, len(pairs), len(points.speed), len(set(points.groups))
    )


def shipped_paths() -> tuple[Path, Path]:
    """Where the twin reads its parameters and profiles (the source tree, in an editable install)."""
    params = Path(__file__).resolve().parents[1] / "sim" / "data" / "twin_params.json"
    return params, data_file("profiles.csv")


def write(calibration: Calibration, params_path: Path, profiles_path: Path) -> None:
    """Both files or neither: each is written beside its target first, then both replace theirs, so that a
    target that cannot be written (a directory, a full disk) leaves the twin's parameters and profiles as
    they were rather than one fit with the other's data."""
    profiles = io.StringIO()
    writer = csv.DictWriter(profiles, fieldnames=FIELDS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(calibration.profiles)
    texts = {params_path: json.dumps(calibration.params(), indent=2) + "\n", profiles_path: profiles.getvalue()}
    written: list[Path] = []
    try:
        for path, text in texts.items():
            if path.is_dir():
                raise IsADirectoryError(f"{path}: is a directory")
            written.append(temp := path.with_name(f".{path.name}.new"))
            temp.write_text(text)
        for temp, path in zip(written, texts, strict=True):
            os.replace(temp, path)
    finally:
        for temp in written:
            temp.unlink(missing_ok=True)
