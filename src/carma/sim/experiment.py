"""Trace experiments on the twin: one configuration, or CARMA's whole configuration list."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

from carma.core.config import OWN_DECISIONS, SchedulerConfig
from carma.core.early import EarlyRestarts
from carma.core.memory import estimated
from carma.core.mig.scheduling import SCHEMES
from carma.core.scheduler import Scheduler
from carma.core.types import MemoryNeed, MigSlot, Target, Task
from carma.metrics.run import RunMetrics, compute_metrics
from carma.metrics.timeline import Segment
from carma.sim.gpus import GpuType, parse_gpus
from carma.sim.hints import activity, durations, history_activity, history_loads, history_peak, loads, pairing
from carma.sim.migspeed import RECONFIGURATION_S
from carma.sim.migtwin import MigTwinServer, full_layouts, geometries, layout_text, mig_server, static_server
from carma.sim.models import SHARING_MODES, InterferenceModel, PowerModel, calibrated_interference, calibrated_power
from carma.sim.twin import TwinServer
from carma.traces.catalog import ESTIMATOR_COLUMNS, HISTORY, MEMORY_SOURCES, Workload
from carma.traces.jitter import jittered
from carma.traces.loaders import Trace

MEMORY_MODES = MEMORY_SOURCES
MIG_MODES = ("off", "dynamic", "static")
# where `warmup_risk` and `pair` learn a task's activity: its workload's profile, or only once a run of it completed
# alone (as the daemon's history learns it: `carma replay` compares the daemon with the latter)
ACTIVITY_SOURCES = ("profile", "history")
_MEMORY_LABELS = {
    "none": "recovery only",
    "oracle": "oracle",
    "horus": "Horus",
    "faketensor": "FakeTensor",
    "xmem": "xMem",
    "xmem" + HISTORY: "xMem + history",
}
# carma's own decisions (`carma.core.config.OWN_DECISIONS`): tasks of known need leave their GPUs open during
# their warm-up, the risk filter counts the activity they will have, and later tasks backfill past a waiting
# head (docs/policy.md); open warm-ups need the needs held, which a configuration may have turned off
OWN = dict.fromkeys((*OWN_DECISIONS, "hold_known_needs"), True)


@dataclass(frozen=True)
class RunConfig:
    """One experiment: a policy, where memory needs come from, and whether the risk filter is on."""

    policy: str  # a registered policy's name
    memory: str = "none"
    risk_filter: bool = True
    # "dynamic": every GPU partitioned per task (`carma.sim.migtwin`); "static": every GPU keeps `layout`, its
    # instances given by best fit; the policy is not used with either
    mig: str = "off"
    scheme: str = "b"  # with dynamic MIG, MIGM's scheme: "a" groups the queue by size, "b" is FIFO
    predict: bool = True  # restart a task early when its memory will outgrow its instance, or its GPU beside others
    own: bool = False  # carma's own decisions (`OWN`) on top of the policy
    layout: tuple[tuple[MigSlot, ...], ...] = ()  # with static MIG: one layout for every GPU, or one per GPU
    activity: str = "profile"  # one of ACTIVITY_SOURCES

    def __post_init__(self) -> None:
        if self.activity not in ACTIVITY_SOURCES:
            raise ValueError(f"unknown activity source {self.activity!r} (choose from {', '.join(ACTIVITY_SOURCES)})")
        if self.memory not in MEMORY_MODES:
            raise ValueError(f"unknown memory mode {self.memory!r} (choose from {', '.join(MEMORY_MODES)})")
        if self.mig not in MIG_MODES:
            raise ValueError(f"unknown MIG mode {self.mig!r} (choose from {', '.join(MIG_MODES)})")
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown MIG scheme {self.scheme!r} (choose from {', '.join(SCHEMES)})")
        if (self.mig == "static") != bool(self.layout):
            raise ValueError("a static MIG run needs a layout, and only a static MIG run takes one")

    @property
    def label(self) -> str:
        if self.mig == "static":
            return f"MIG static {self.layout_text} {_MEMORY_LABELS.get(self.memory, 'GPUMemNet')}"
        if self.mig == "dynamic":
            memory = _MEMORY_LABELS.get(self.memory, "GPUMemNet")
            return f"MIG scheme {self.scheme.upper()} {memory}" + ("" if self.predict else ", no prediction")
        if self.policy == "exclusive":
            return "Exclusive"
        policy = self.policy.upper()
        memory = _MEMORY_LABELS.get(self.memory, "GPUMemNet")
        return (
            f"{policy} {memory}"
            + ("" if self.risk_filter else ", no risk filter")
            + (", carma's own" if self.own else "")
            + ("" if self.predict else ", no prediction")
            + (", activity from history" if self.activity == "history" else "")
        )

    @property
    def layout_text(self) -> str:
        """The static layout, each GPU's as `--layout` reads it, GPUs apart by `;`."""
        return ";".join(layout_text(slots) for slots in self.layout)


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


# carma's own combination (docs/policy.md): xMem's estimates (a whole GPU where it has none), interference-aware
# pairing, open warm-ups for known needs and backfilling; the sweep's last row
OWN_RUN = RunConfig("pair", "xmem", own=True)
SWEEP: tuple[RunConfig, ...] = (*PAPER_SWEEP, OWN_RUN)


def paper_sweep(risk_filter: bool = True) -> tuple[RunConfig, ...]:
    """The paper's configurations and carma's own; with the risk filter switched off (the configuration file's
    `[scheduler.risk] enabled = false`), every one runs without it, and the one that differed only there
    is dropped."""
    if risk_filter:
        return SWEEP
    return tuple(dict.fromkeys(replace(run, risk_filter=False) for run in SWEEP))


@dataclass(frozen=True)
class TwinConfig:
    """The simulated server and the scheduler settings every run starts from."""

    gpus: tuple[GpuType, ...] = field(default_factory=lambda: parse_gpus("3xA100-40GB"))
    sharing: str = "mps"
    fragmentation: float = 0.05  # allowance: fraction of co-runners' memory unusable by a new allocation
    interference: InterferenceModel = field(default_factory=calibrated_interference)
    power: PowerModel = field(default_factory=calibrated_power)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    reconfiguration_s: float = RECONFIGURATION_S  # one MIG plan step (not measured: `carma.sim.migspeed`)

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
    reconfigurations: int | None = None  # MIG layout changes (MIG runs only)
    switches: tuple[str, ...] = ()  # carma's own decisions the twin's configuration turned on, in words

    @property
    def label(self) -> str:
        """The configuration's name, with the decisions a configuration file turned on beside it: a run with
        `backfill = true` is not the paper's MAGM."""
        return self.config.label + "".join(f", {words}" for words in self.switches)

    def row(self) -> dict[str, object]:
        """The run as one flat record (the `--json` and CSV row)."""
        m = self.metrics
        return {
            "config": self.label,
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
        } | (self._mig_row() if self.reconfigurations is not None else {})

    @property
    def early_restarts(self) -> int:
        """Attempts stopped on a growth prediction (`carma.core.early`), relaunched before they ran out of memory."""
        return sum(a.restarted_early for t in self.tasks for a in t.attempts)

    def _mig_row(self) -> dict[str, object]:
        m = self.metrics
        hours = m.makespan_s / 3600
        dynamic = self.config.mig == "dynamic"
        row: dict[str, object] = {
            "mig": self.config.mig,
            "scheme": self.config.scheme if dynamic else None,
            "predict": self.config.predict and dynamic,
            "reconfigurations": self.reconfigurations,
            "early_restarts": self.early_restarts,
            "throughput_tasks_per_h": round(m.tasks_completed / hours, 2) if hours else None,
        }
        if not dynamic:
            row["layout"] = self.config.layout_text
        return row


class RecordedEstimator:
    """An estimator port that answers with the estimate recorded for each task's workload (CARMA's table,
    or a trace entry's own `<estimator>_mib`); where none is recorded, with `history`'s peak when it gives one
    (`carma.sim.hints.history_peak`), else a whole GPU. The recorded xMem estimates are the daemon's, so a
    multi-GPU task's is partial as there (`carma.server.estimates`); the baselines' are CARMA's, placed as
    CARMA placed them."""

    def __init__(
        self,
        name: str,
        workload_of: Callable[[Task], Workload],
        history: Callable[[Task], int | None] | None = None,
    ) -> None:
        self.name = name
        self._workload_of = workload_of
        self._history = history

    def need(self, task: Task) -> MemoryNeed:
        recorded = self._workload_of(task).estimates.get(self.name)
        if recorded is None and self._history is not None and (peak := self._history(task)) is not None:
            return estimated("history", peak)
        return estimated(self.name, recorded, partial=self.name == "xmem" and task.spec.gpus > 1)


def simulate(
    trace: Trace, run: RunConfig, twin: TwinConfig | None = None, growing: Mapping[str, int] | None = None
) -> RunResult:
    """Run `trace`; the workloads named in `growing` grow to that memory (MiB) by their end."""
    twin = twin or TwinConfig()
    config = replace(
        twin.scheduler,
        policy=run.policy,
        risk=replace(twin.scheduler.risk, enabled=run.risk_filter),
        predict_growth=run.predict,
        **(OWN if run.own else {}),
    )

    # A task's own entry's workload (two entries of one name may differ in their recorded estimates): asked once
    # the task is submitted, so the server knows it.
    def workload_of(task: Task) -> Workload:
        return server.workload(task.id)

    source = run.memory.removesuffix(HISTORY)
    history = history_peak(workload_of, lambda: server.loop.scheduler.tasks) if source != run.memory else None
    estimator = RecordedEstimator(source, workload_of, history) if source in ESTIMATOR_COLUMNS else None

    def make_scheduler(gpus: list[Target]) -> Scheduler:
        tasks = lambda: server.loop.scheduler.tasks  # noqa: E731
        profile = run.activity == "profile"
        hints = {
            "durations": durations(workload_of),
            "pairing": pairing(
                twin.interference, twin.sharing, loads(workload_of) if profile else history_loads(workload_of, tasks)
            ),
            "activity": activity(workload_of) if profile else history_activity(workload_of, tasks),
        }
        warmup = lambda task: workload_of(task).warmup_s  # noqa: E731 (read only by the prediction)
        early = EarlyRestarts(remaining, warmup, instances=False)
        return Scheduler(gpus, config, estimator, early=early, **hints)

    def remaining(task: Task, now: float) -> float | None:
        return server.left_s(task.id)

    server = (
        mig_server(
            twin.gpus,
            config,
            estimator,
            run.scheme,
            twin.power,
            oracle_memory=run.memory == "oracle",
            predict=run.predict,
            growing=growing,
            step_s=twin.reconfiguration_s,
        )
        if run.mig == "dynamic"
        else static_server(
            twin.gpus,
            config,
            estimator,
            twin.power,
            oracle_memory=run.memory == "oracle",
            layouts=run.layout,
            growing=growing,
        )
        if run.mig == "static"
        else TwinServer(
            twin.gpus,
            make_scheduler,
            twin.interference,
            twin.sharing,
            twin.power,
            twin.fragmentation,
            oracle_memory=run.memory == "oracle",
            growing=growing,
        )
    )
    server.run(trace)
    tasks = tuple(server.loop.scheduler.tasks)
    timelines = tuple(tuple(t) for t in server.timelines)
    reconfigurations = server.reconfigurations if isinstance(server, MigTwinServer) else None
    metrics = compute_metrics(tasks, timelines)
    switches = () if run.own else tuple(words for name, words in OWN_DECISIONS.items() if getattr(config, name))
    return RunResult(run, metrics, tasks, timelines, tuple(g.name for g in twin.gpus), reconfigurations, switches)


Work = tuple[Trace, RunConfig, TwinConfig, Mapping[str, int] | None]


def _simulate_args(args: Work) -> RunResult:
    return simulate(*args)


def _simulate_all(work: Sequence[Work], jobs: int, progress: Callable[[RunResult], None] | None) -> list[RunResult]:
    """Every simulation of `work`, in `jobs` processes; results in its order."""
    jobs = max(1, min(jobs, len(work)))
    results: list[RunResult] = []
    with ProcessPoolExecutor(max_workers=jobs) if jobs > 1 else nullcontext() as pool:
        for result in (pool.map if pool else map)(_simulate_args, work):
            results.append(result)
            if progress:
                progress(result)
    return results


def sweep(
    trace: Trace,
    runs: Sequence[RunConfig] = PAPER_SWEEP,
    twin: TwinConfig | None = None,
    jobs: int = 1,
    progress: Callable[[RunResult], None] | None = None,
    growing: Mapping[str, int] | None = None,
) -> list[RunResult]:
    """Run every configuration, in `jobs` processes (worth it for long traces); results keep the given order."""
    twin = twin or TwinConfig()
    return _simulate_all([(trace, run, twin, growing) for run in runs], jobs, progress)


def seeded_sweep(
    trace: Trace,
    runs: Sequence[RunConfig],
    jitter_s: float,
    seeds: Sequence[int],
    twin: TwinConfig | None = None,
    jobs: int = 1,
    progress: Callable[[RunResult], None] | None = None,
) -> list[list[RunResult]]:
    """Every configuration on each seed's jittered copy of `trace` (`carma.traces.jitter`): one list of results
    per seed, in `runs`' order, so that a comparison reads over arrival patterns, not one."""
    twin = twin or TwinConfig()
    copies = [jittered(trace, jitter_s, seed) for seed in seeds]
    results = _simulate_all([(copy, run, twin, None) for copy in copies for run in runs], jobs, progress)
    return [results[i : i + len(runs)] for i in range(0, len(results), len(runs))]


def static_layouts(gpus: Sequence[GpuType], need_mib: int) -> list[tuple[tuple[MigSlot, ...], ...]]:
    """The layouts a search for the best static one tries, one per GPU: every full layout (`full_layouts`) on
    every GPU, and on a server of n GPUs also with the first k < n kept whole (one instance of the largest
    profile) and the layout on the rest, for tasks too large for its instances. A layout whose largest instance
    holds no `need_mib` (the largest need with the margin) is left out: that task would never run. Not every
    mix of layouts: the same one on every partitioned GPU (n x 78 runs on an A100, not 78^n)."""
    models = {g.name for g in gpus}
    if len(models) != 1:
        raise ValueError(f"a static layout search takes GPUs of one model, not {', '.join(sorted(models))}")
    geometry = next(iter(geometries(gpus[:1]).values()))
    whole = (MigSlot(geometry.sizing[-1].name, 0),)
    memory = {p.name: p.memory_mib or 0 for p in geometry.sizing}
    found = [(whole,) * k + (layout,) * (len(gpus) - k) for k in range(len(gpus)) for layout in full_layouts(geometry)]
    return [
        layouts
        for layouts in dict.fromkeys(found)
        if max(memory[s.profile] for layout in layouts for s in layout) >= need_mib
    ]


def best_static(
    trace: Trace,
    twin: TwinConfig,
    memory: str = "oracle",
    growing: Mapping[str, int] | None = None,
    jobs: int = 1,
) -> tuple[RunResult, int]:
    """MISO's baseline: of the static layouts (`static_layouts`), the run with the shortest makespan in which
    every task completes, and how many layouts were run. The trace's largest need (its catalog figure, whatever
    `memory` the runs are given) decides which layouts can run it at all."""
    need = max(e.workload.mem_mib for e in trace.entries) + twin.scheduler.margin_mib
    runs = [RunConfig("bf", memory, mig="static", layout=layout) for layout in static_layouts(twin.gpus, need)]
    done = [r for r in sweep(trace, runs, twin, jobs, growing=growing) if not r.metrics.tasks_failed]
    if not done:
        raise ValueError(f"no static MIG layout of {twin.gpus[0].name} runs every task of {trace.name}")
    return min(done, key=lambda r: r.metrics.makespan_s), len(runs)
