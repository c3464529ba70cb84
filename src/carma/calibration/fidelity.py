"""`carma twin validate`: the fidelity report (docs/fidelity.md), generated from data by one command."""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from carma.calibration.calibrate import ENERGY_GPU, Calibration
from carma.calibration.interference import PairCheck, Validation, check_thesis_pair, cross_validate, pair_points
from carma.calibration.power import EnergyRow, energy_check, measured_ratios
from carma.calibration.sources import load_lucid, package_rows
from carma.reports.tables import change_pct
from carma.sim.experiment import PAPER_SWEEP, RunResult, TwinConfig, sweep
from carma.sim.models import twin_params
from carma.traces.catalog import load_catalog
from carma.traces.loaders import load_trace

MAE_TARGET = 0.08
PAPER_RECOVERY_MAKESPAN = -35.0  # CARMA abstract and section 3.3
WITHIN_PP = 10.0


@dataclass(frozen=True)
class Fidelity:
    calibration: Calibration
    validation: Validation
    pair_checks: list[PairCheck]
    energy_rows: list[EnergyRow]
    results: list[RunResult]
    shipped_matches_fit: bool


def evaluate(calibration: Calibration, data: Path, jobs: int = 1) -> Fidelity:
    """Validate the fitted models and run trace 1 with the twin as shipped."""
    _, pairs = load_lucid(data)
    validation = cross_validate(pair_points(pairs))
    model, power = calibration.interference, calibration.power
    pair_checks = check_thesis_pair(model, package_rows("thesis_pair.csv"), calibration.relation)
    energy_rows = energy_check(
        model, power, ENERGY_GPU, calibration.small_workload, measured_ratios(package_rows("thesis_energy.csv"))
    )
    trace = load_trace("carma-t1", load_catalog())
    results = sweep(trace, PAPER_SWEEP, TwinConfig(), jobs=jobs)
    return Fidelity(calibration, validation, pair_checks, energy_rows, results, twin_params() == calibration.params())


# ----------------------------------------------------------------------------- the report


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.1f}%"


def _changes(results: Sequence[RunResult]) -> dict[str, dict[str, float | None]]:
    base = next(r for r in results if r.config.label == "Exclusive").metrics
    out = {}
    for r in results:
        m = r.metrics
        out[r.config.label] = {
            "makespan_change_pct": change_pct(m.makespan_s, base.makespan_s),
            "energy_change_pct": change_pct(m.energy_mj, base.energy_mj),
            "smact_change_pct": change_pct(m.smact_mean, base.smact_mean),
            "smocc_change_pct": change_pct(m.smocc_mean, base.smocc_mean),
            "mem_change_pct": change_pct(m.mem_used_mean_mib, base.mem_used_mean_mib),
        }
    return out


@dataclass(frozen=True)
class Finding:
    claim: str
    holds: bool
    detail: str


def findings(f: Fidelity) -> list[Finding]:
    """The paper's qualitative findings on trace 1, checked on the twin."""
    by = {r.config.label: r.metrics for r in f.results}
    ch = _changes(f.results)
    exclusive = by["Exclusive"]
    collocating = [label for label in by if label != "Exclusive"]
    slower = [label for label in collocating if by[label].makespan_s >= exclusive.makespan_s]
    recovery = {label: ch[label]["makespan_change_pct"] for label in ("MAGM recovery only", "LUG recovery only")}
    estimators = [label for label in by if any(e in label for e in ("Horus", "FakeTensor", "GPUMemNet"))]
    fewer_ooms, less_mem = [], []
    for label in estimators:
        policy = label.split()[0]
        base = by[f"{policy} recovery only"]
        fewer_ooms.append(by[label].oom_crashes < base.oom_crashes or base.oom_crashes == 0)
        less_mem.append(by[label].mem_used_mean_mib < base.mem_used_mean_mib)
    bf_energy = ch["BF oracle"]["energy_change_pct"]
    return [
        Finding(
            "every collocating configuration finishes sooner than Exclusive",
            not slower,
            "all of them" if not slower else f"not: {', '.join(slower)}",
        ),
        Finding(
            f"recovery-only MAGM and LUG lie within {WITHIN_PP:g} points of the paper's {PAPER_RECOVERY_MAKESPAN:g}%",
            all(abs(v - PAPER_RECOVERY_MAKESPAN) <= WITHIN_PP for v in recovery.values()),
            ", ".join(f"{k}: {_pct(v)}" for k, v in recovery.items()),
        ),
        Finding(
            "estimator-based runs have fewer OOM crashes than recovery-only ones",
            all(fewer_ooms),
            ", ".join(f"{label}: {by[label].oom_crashes}" for label in estimators)
            + f" against {by['MAGM recovery only'].oom_crashes} (MAGM) and {by['LUG recovery only'].oom_crashes} (LUG)",
        ),
        Finding(
            "estimator-based runs collocate less (less memory in use) than recovery-only ones",
            all(less_mem),
            ", ".join(f"{label}: {by[label].mem_used_mean_mib / 1024:.1f} GiB" for label in estimators)
            + f" against {by['MAGM recovery only'].mem_used_mean_mib / 1024:.1f} GiB",
        ),
        Finding(
            "collocation raises mean SMACT",
            all(by[label].smact_mean > exclusive.smact_mean for label in collocating),
            f"Exclusive {exclusive.smact_mean:.2f}; MAGM recovery only {by['MAGM recovery only'].smact_mean:.2f}",
        ),
        Finding(
            "oracle BF uses more energy than Exclusive (the paper's finding)",
            bf_energy is not None and bf_energy > 0,
            f"twin: {_pct(bf_energy)}",
        ),
    ]


def render(f: Fidelity, command: str) -> str:
    cal, val = f.calibration, f.validation
    a, p, q = cal.timeslice
    rel = cal.relation
    ch = _changes(f.results)
    paper = {(row["config"], row["metric"]): float(row["value"]) for row in package_rows("paper_t1.csv")}
    by = {r.config.label: r.metrics for r in f.results}
    checks = findings(f)
    best_baseline = min(val.baseline_mae.values())
    parts = [
        "# Fidelity of the digital twin",
        f"Generated by `{command}` on {datetime.date.today().isoformat()}; do not edit by hand. "
        "How the models are built is in [twin-model.md](twin-model.md).",
        "The twin shipped with carma "
        + (
            "uses exactly the parameters fitted here."
            if f.shipped_matches_fit
            else "**differs from this fit: run `carma twin calibrate` and commit the result.**"
        ),
        "## 1. Interference: time-slicing, fitted on Lucid's measured pairs",
        f"Model: a job's collocated speed = 1 / (1 + a · g_own^p · g_others^q), g = busy time (nvidia-smi "
        f"utilization, GRACT). Fitted by least absolute error on {cal.pair_points} measured speeds from "
        f"{cal.pairs} pairs: **a = {a:.3f}, p = {p:.2f}, q = {q:.2f}**.",
        f"Validation: {val.folds}-fold cross-validation grouped by the unordered pair of models "
        f"({val.groups} pairings; every configuration of a pairing is held out together).",
        _table(
            ["predictor", "held-out MAE of relative speed"],
            [["**carma time-slicing model**", f"**{val.model_mae:.4f}**"]]
            + [[name, f"{mae:.4f}"] for name, mae in val.baseline_mae.items()],
        ),
        f"Target: held-out MAE at most {MAE_TARGET} and clearly below both baselines: "
        + (
            f"**met** ({val.model_mae:.4f}; {100 * (1 - val.model_mae / best_baseline):.0f}% below the better "
            "baseline)."
            if val.model_mae <= MAE_TARGET and val.model_mae < best_baseline
            else f"**not met** ({val.model_mae:.4f})."
        )
        + f" Per fold: {', '.join(f'{m:.3f}' for m in val.fold_mae)}; in-sample MAE {val.in_sample_mae:.4f}. "
        "Pairs of jobs that barely use the GPU still scatter by about 0.045 around speed 1: that much is "
        "measurement noise no model removes.",
        "## 2. MPS against time-slicing: the thesis's DLRM + ResNet152 pair",
        f"MPS keeps **{cal.mps_share:.3f}** of time-slicing's excess slowdown (thesis Table 4.4: MPS adds 4% and "
        "4%, naive sharing 14% and 5%), and cannot exceed the SMs or the memory bandwidth "
        "(slowdown >= sum of SMACT, sum of DRAMA). The naive column checks the Lucid fit on the thesis's A100 "
        "(busy time from the measured SMACT by the inverse GPUMemNet relation); the MPS column is the same "
        "pair the share was taken from.",
        _table(
            ["workload", "naive: measured", "naive: twin", "MPS: measured", "MPS: twin"],
            [
                [
                    c.workload,
                    _pct(100 * c.naive_measured),
                    _pct(100 * c.naive_predicted),
                    _pct(100 * c.mps_measured),
                    _pct(100 * c.mps_predicted),
                ]
                for c in f.pair_checks
            ],
        ),
        "## 3. Busy time to DCGM metrics (GPUMemNet's runs)",
        f"SMACT = clip({rel.slope:.3f} · (GRACT − {rel.offset:.3f}), 0, 1), MAE {rel.smact_mae:.3f}; "
        f"SMOCC = {rel.smocc_scale:.3f} · SMACT^{rel.smocc_power:.2f}, MAE {rel.smocc_mae:.3f} "
        f"(fitted on {rel.runs} runs).",
        "## 4. Power and energy: thesis Table 4.2 (ResNet26/CIFAR-10, batch 32, one A100-40GB)",
        f"Power = idle + (max − idle) · SMACT^γ with the A100-40GB's {ENERGY_GPU.idle_w:g} W idle and "
        f"{ENERGY_GPU.max_w:g} W board power; **γ = {cal.power_exponent:.3f}**, fitted on the MPS rows. "
        f"The workload's profile comes from the same rule as CARMA's tasks (GRACT {cal.small_workload.gract:.2f}, "
        f"SMACT {cal.small_workload.smact:.2f}); the naive rows are held out.",
        _table(
            ["sharing", "copies", "energy vs 1X: measured", "twin", "error"],
            [
                [
                    r.mode + (" (fitted)" if r.mode == "mps" else " (held out)"),
                    r.tasks,
                    f"{r.measured:.2f}",
                    f"{r.predicted:.2f}",
                    _pct(100 * (r.predicted / r.measured - 1)),
                ]
                for r in f.energy_rows
            ],
        ),
        "## 5. Trace 1 on the twin against CARMA's headline figures",
        "3x A100-40GB, MPS, the paper's configuration list; changes against Exclusive. Paper values where the "
        "text states them (the figures' bars were lost in extraction).",
        _table(
            ["configuration", "makespan: twin", "paper", "energy: twin", "paper", "OOMs", "SMACT: twin", "paper"],
            [
                [
                    label,
                    _pct(ch[label]["makespan_change_pct"]),
                    _pct(paper.get((label, "makespan_change_pct"))),
                    _pct(ch[label]["energy_change_pct"]),
                    _pct(paper.get((label, "energy_change_pct"))),
                    by[label].oom_crashes,
                    _pct(ch[label]["smact_change_pct"]),
                    _pct(paper.get((label, "smact_change_pct"))),
                ]
                for label in by
            ],
        ),
        f"MAGM recovery only, against the abstract's best policy: SMOCC "
        f"{_pct(ch['MAGM recovery only']['smocc_change_pct'])} (paper +61%), memory in use "
        f"{_pct(ch['MAGM recovery only']['mem_change_pct'])} (paper +62%). Exclusive takes "
        f"{by['Exclusive'].makespan_s / 3600:.2f} h and {by['Exclusive'].energy_mj:.1f} MJ.",
        "### The paper's findings, checked",
        _table(["finding", "twin", "detail"], [[c.claim, "yes" if c.holds else "**no**", c.detail] for c in checks]),
        "### Where the twin disagrees, and why",
        _disagreements(f),
        "## 6. Reproducing this report",
        "```sh\nmake setup\n.venv/bin/carma twin calibrate   # refit; rewrites src/carma/sim/data/twin_params.json and "
        "src/carma/traces/data/profiles.csv\n.venv/bin/carma twin validate    # this report\n```",
        "Shipped parameters:",
        "```json\n" + json.dumps(twin_params(), indent=2) + "\n```",
    ]
    return "\n\n".join(parts) + "\n"


def _disagreements(f: Fidelity) -> str:
    by = {r.config.label: r.metrics for r in f.results}
    same = [
        label
        for label in ("FF oracle", "BF oracle", "LUG oracle")
        if abs(by[label].makespan_s / by["MAGM oracle"].makespan_s - 1) < 0.005
    ]
    notes = []
    if same:
        notes.append(
            f"- **Policies coincide** ({', '.join(same)} finish within 0.5% of MAGM oracle; MAGM and LUG "
            "recovery-only alike). On this trace the TTFK grace windows and the memory precondition leave at most one "
            "candidate GPU in most decisions, and where there are more, the GPU with the most free memory is also "
            "the least busy. The paper's runs differ in these details through run-to-run variation the twin "
            "does not model (its samples are noise-free)."
        )
    bf = _changes(f.results)["BF oracle"]["energy_change_pct"]
    if bf is not None and bf <= 0:
        notes.append(
            f"- **Oracle BF saves energy in the twin ({_pct(bf)}) where the paper measured more energy than "
            "Exclusive.** carma, like CARMA's reference code, sends a task to a whole idle GPU whenever one is "
            "free and packs only when none is; BF's tighter packing then only matters when no GPU is idle, and "
            "the twin's makespan (and with it the idle GPUs' energy) shrinks as for the other policies. The "
            "paper attributes BF's extra energy to GPUs driven to peak power by saturation; in the twin a "
            "saturated GPU draws its board power too, but the time saved outweighs it. Whether BF packs harder "
            "in CARMA's runs than its code suggests cannot be told from the text."
        )
    rr = _changes(f.results)["RR recovery only"]["makespan_change_pct"]
    if rr is not None and rr > -30.6 + 3:
        notes.append(
            f"- **RR gains less ({_pct(rr)} against −30.6%).** Without preconditions RR crashes "
            f"{by['RR recovery only'].oom_crashes} tasks out of memory in the twin; each loses its start-up and "
            "waits for a whole GPU. The paper does not report RR's OOM count."
        )
    dlrm = next((c for c in f.pair_checks if c.workload == "dlrm"), None)
    if dlrm and dlrm.naive_measured - dlrm.naive_predicted > 0.05:
        notes.append(
            f"- **DLRM beside ResNet152 under naive sharing** ({_pct(100 * dlrm.naive_predicted)} against "
            f"{_pct(100 * dlrm.naive_measured)}). DLRM's SMACT is 5%, so kernel "
            "collisions, all the Lucid-fitted model sees, barely delay it; the thesis itself notes that SM activity "
            "does not rise under this collocation and the slowdown comes from another resource. A memory-heavy "
            "co-runner's interference is outside what busy time can predict."
        )
    seven = next((r for r in f.energy_rows if r.mode == "naive" and r.tasks == 7), None)
    if seven and seven.predicted < 0.9 * seven.measured:
        notes.append(
            f"- **Seven-way naive sharing** takes {seven.measured:.2f} times the energy of one job in the thesis, "
            f"{seven.predicted:.2f} times in the twin. The time-slicing model is fitted on pairs; "
            "the cost of switching between seven contexts grows faster than the pairwise collisions it "
            "extrapolates. Traces rarely put seven tasks on one GPU, but the twin is optimistic there."
        )
    notes.append(
        "- **Noise-free telemetry.** The twin's samples are constant between events, so the risk score's tail "
        "(p95) and trend (EMA) only matter during transitions; real SMACT fluctuates within a training step."
    )
    return "\n".join(notes)


# The report's date: a report whose figures did not change keeps the one it had.
_DATE = re.compile(r"(Generated by `[^`]*` on )\d{4}-\d{2}-\d{2}")


def write_report(f: Fidelity, path: Path, command: str) -> bool:
    """Write the report to `path`, unless it already says the same apart from its date: a validation that
    changed no figure rewrote the date alone, leaving the checkout's docs/fidelity.md modified. Whether
    it wrote."""
    text = render(f, command)
    if path.is_file() and _DATE.sub(r"\1", path.read_text()) == _DATE.sub(r"\1", text):
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return True
