"""Trace experiments on the twin: one configuration, or CARMA's whole configuration list."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

from carma.core.config import SchedulerConfig
from carma.core.memory import estimated
from carma.core.scheduler import Scheduler
from carma.core.types import GpuInfo, MemoryNeed, Task
from carma.metrics.run import RunMetrics, compute_metrics
from carma.metrics.timeline import Segment
from carma.sim.gpus import GpuType, parse_gpus
from carma.sim.models import SHARING_MODES, InterferenceModel, PowerModel, calibrated_interference, calibrated_power
from carma.sim.twin import TwinServer
from carma.traces.catalog import ESTIMATOR_COLUMNS, MEMORY_SOURCES, Workload
from carma.traces.loaders import Trace

MEMORY_MODES = MEMORY_SOURCES
_MEMORY_LABELS = {"none": "recovery only", "oracle": "oracle", "horus": "Horus", "faketensor": "FakeTensor"}


@dataclass(frozen=True)
class RunConfig:
    """One experiment: a policy, where memory needs come from, and whether the risk filter is on."""

    policy: str  # a registered policy's name
    memory: str = "none"
    risk_filter: bool = True

    def __post_init__(self) -> None:
        if self.memory not in MEMORY_MODES:
            raise ValueError(f"unknown memory mode {self.memory!r} (choose from {', '.join(MEMORY_MODES)})")

    @property
    def label(self) -> str:
        if self.policy == "exclusive":
            return "Exclusive"
        policy = self.policy.upper()
        memory = _MEMORY_LABELS.get(self.memory, "GPUMemNet")
        return f"{policy} {memory}" + ("" if self.risk_filter else ", no risk filter")


# The paper's configurations for trace 1 (CARMA, section 3 and figure 2).
PAPER_SWEEP: tuple[RunConfig, ...] = (
    RunConfig("exclusive"),
    RunConfig("rr"),
    RunConfig("magm"),
    RunConfig("lug"),
    RunConfig("ff", "oracle"),
    RunConfig("bf", "oracle"),
    RunConfig("magm", "oracle"),
    RunConfig("magm", "oracle", risk_filter=False),
    RunConfig("lug", "oracle"),
    *(RunConfig(p, est) for est in ("horus", "faketensor", "gpumemnet") for p in ("magm", "lug")),
)


def paper_sweep(risk_filter: bool = True) -> tuple[RunConfig, ...]:
    """The paper's configurations; with the risk filter switched off (the configuration file's
    `[scheduler.risk] enabled = false`), every one runs without it, and the one that differed only there
    is dropped."""
    if risk_filter:
        return PAPER_SWEEP
    return tuple(dict.fromkeys(replace(run, risk_filter=False) for run in PAPER_SWEEP))


@dataclass(frozen=True)
class TwinConfig:
    """The simulated server and the scheduler settings every run starts from."""

    gpus: tuple[GpuType, ...] = field(default_factory=lambda: parse_gpus("3xA100-40GB"))
    sharing: str = "mps"
    fragmentation: float = 0.05  # allowance: fraction of co-runners' memory unusable by a new allocation
    interference: InterferenceModel = field(default_factory=calibrated_interference)
    power: PowerModel = field(default_factory=calibrated_power)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.sharing not in SHARING_MODES:
            raise ValueError(f"unknown sharing mode {self.sharing!r} (choose from {', '.join(SHARING_MODES)})")
        if not 0.0 <= self.fragmentation < 1.0:
            raise ValueError("fragmentation allowance must be a fraction in [0, 1)")


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


@dataclass(frozen=True)
class RunResult:
    config: RunConfig
    metrics: RunMetrics
    tasks: tuple[Task, ...]
    timelines: tuple[tuple[Segment, ...], ...]
    gpus: tuple[str, ...]

    def row(self) -> dict[str, object]:
        """The run as one flat record (the `--json` and CSV row)."""
        m = self.metrics
        return {
            "config": self.config.label,
            "policy": self.config.policy,
            "memory": self.config.memory,
            "risk_filter": self.config.risk_filter,
            "makespan_s": round(m.makespan_s, 1),
            "energy_mj": round(m.energy_mj, 4),
            "energy_per_task_kj": _round(m.energy_per_task_kj, 1),
            "oom_crashes": m.oom_crashes,
            "wait_mean_s": _round(m.wait_mean_s, 1),
            "wait_p95_s": _round(m.wait_p95_s, 1),
            "exec_mean_s": _round(m.exec_mean_s, 1),
            "exec_p95_s": _round(m.exec_p95_s, 1),
            "jct_p95_s": _round(m.jct_p95_s, 1),
            "jct_mean_s": _round(m.jct_mean_s, 1),
            "power_mean_w": round(m.power_mean_w, 1),
            "smact_mean": round(m.smact_mean, 4),
            "smocc_mean": round(m.smocc_mean, 4),
            "drama_mean": round(m.drama_mean, 4),
            "mem_used_mean_mib": round(m.mem_used_mean_mib, 1),
            "tasks_completed": m.tasks_completed,
            "tasks_failed": m.tasks_failed,
        }


class RecordedEstimator:
    """An estimator port that answers with the estimate recorded for each task's workload (CARMA's table,
    or a trace entry's own `<estimator>_mib`)."""

    def __init__(self, name: str, workload_of: Callable[[Task], Workload]) -> None:
        self.name = name
        self._workload_of = workload_of

    def need(self, task: Task) -> MemoryNeed:
        return estimated(self.name, self._workload_of(task).estimates.get(self.name))


def simulate(trace: Trace, run: RunConfig, twin: TwinConfig | None = None) -> RunResult:
    twin = twin or TwinConfig()
    config = replace(
        twin.scheduler,
        policy=run.policy,
        risk=replace(twin.scheduler.risk, enabled=run.risk_filter),
    )
    # Asked once a task is submitted, so the server knows its entry's workload (two entries of one name may
    # differ in their recorded estimates).
    estimator = (
        RecordedEstimator(run.memory, lambda task: server.workload(task.id))
        if run.memory in ESTIMATOR_COLUMNS
        else None
    )

    def make_scheduler(gpus: list[GpuInfo]) -> Scheduler:
        return Scheduler(gpus, config, estimator)

    server = TwinServer(
        twin.gpus,
        make_scheduler,
        twin.interference,
        twin.sharing,
        twin.power,
        twin.fragmentation,
        oracle_memory=run.memory == "oracle",
    )
    server.run(trace)
    tasks = tuple(server.loop.scheduler.tasks)
    timelines = tuple(tuple(t) for t in server.timelines)
    return RunResult(run, compute_metrics(tasks, timelines), tasks, timelines, tuple(g.name for g in twin.gpus))


def _simulate_args(args: tuple[Trace, RunConfig, TwinConfig]) -> RunResult:
    return simulate(*args)


def sweep(
    trace: Trace,
    runs: Sequence[RunConfig] = PAPER_SWEEP,
    twin: TwinConfig | None = None,
    jobs: int = 1,
    progress: Callable[[RunResult], None] | None = None,
) -> list[RunResult]:
    """Run every configuration, in `jobs` processes (worth it for long traces); results keep the given order."""
    twin = twin or TwinConfig()
    jobs = max(1, min(jobs, len(runs)))
    work = [(trace, run, twin) for run in runs]
    results: list[RunResult] = []
    with ProcessPoolExecutor(max_workers=jobs) if jobs > 1 else nullcontext() as pool:
        for result in (pool.map if pool else map)(_simulate_args, work):
            results.append(result)
            if progress:
                progress(result)
    return results
