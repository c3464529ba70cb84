"""What the twin tells the core beyond telemetry, as a server with history would know it: each task's expected
duration (backfilling), how much collocated tasks slow each other (interference-aware pairing), the activity a
task brings to its GPU (the risk of tasks still warming up: from its profile, or as the daemon learns it), and
the peak of a workload's earlier runs (the daemon's default memory estimate).

A duration is the workload's solo time from the trace's catalog, the figure a daemon's history of earlier runs
of the same command gives; the interference model is the twin's own fitted one (the daemon's too, over its
history). The core receives both as ports (`carma.core.backfill.DurationOf`,
`carma.core.policies.pair.PairingModel`) and imports nothing here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from carma.core.backfill import DurationOf
from carma.core.policies.pair import PairingModel
from carma.core.risk import Activity, ActivityOf
from carma.core.types import Attempt, Task, TaskId, TaskState
from carma.sim.models import InterferenceModel, Load
from carma.traces.catalog import Workload

WorkloadOf = Callable[[Task], Workload]


def durations(workload_of: WorkloadOf) -> DurationOf:
    """Each task's solo time, launch to exit."""
    return lambda task: workload_of(task).solo_s


def activity(workload_of: WorkloadOf) -> ActivityOf:
    """Each task's solo SMACT, SMOCC and DRAMA from the catalog's profile, the figures telemetry shows of it
    alone (the daemon's come from each command's runs alone: `carma.server.history`)."""

    def of(task: Task) -> Activity:
        w = workload_of(task)
        return Activity(w.smact, w.smocc, w.drama)

    return of


def loads(workload_of: WorkloadOf) -> Callable[[Task], Load]:
    """Each task's solo load (GRACT, SMACT, SMOCC, DRAMA) from the catalog's profile."""

    def of(task: Task) -> Load:
        w = workload_of(task)
        return Load(w.gract, w.smact, w.smocc, w.drama)

    return of


def pairing(model: InterferenceModel, sharing: str, load_of: Callable[[Task], Load | None]) -> PairingModel:
    """The rise in the summed slowdowns of a GPU's tasks when `task` joins them, by `load_of` (the catalog's
    profiles, or what history knows of them: the daemon's `carma.server.history`); None when a load is not known."""

    def cost(task: Task, others: Sequence[Task]) -> float | None:
        joining, rest = load_of(task), [load_of(t) for t in others]
        if joining is None or None in rest:
            return None
        return model.rise(joining, rest, sharing)  # type: ignore[arg-type]

    return cost


def history_peak(workload_of: WorkloadOf, tasks: Callable[[], Iterable[Task]]) -> Callable[[Task], int | None]:
    """The daemon's default estimator (`[estimate] default = "history"`: the largest peak of the command's earlier
    successful runs) as the twin knows it: the largest memory (the catalog's peak) of the runs of the task's
    workload that completed in this simulation before the task's need is asked for; None before any did. Causal,
    not an oracle: a run still going, or one that crashed, tells nothing."""

    def peak(task: Task) -> int | None:
        name = task.spec.name
        done = (t for t in tasks() if t.state is TaskState.COMPLETED and t.spec.name == name)
        return max((workload_of(t).mem_mib for t in done), default=None)

    return peak


def history_activity(workload_of: WorkloadOf, tasks: Callable[[], Iterable[Task]]) -> ActivityOf:
    """`warmup_risk`'s activity as the daemon learns it (`carma.server.history`: from a command's successful runs
    alone on their GPUs): a workload's profile once one of its runs completed in this simulation with no other
    task's attempt on its GPUs meanwhile; None before. Causal, as `history_peak`."""
    profile, learnt = activity(workload_of), history_learnt(tasks)
    return lambda task: profile(task) if learnt(task) else None


def history_loads(workload_of: WorkloadOf, tasks: Callable[[], Iterable[Task]]) -> Callable[[Task], Load | None]:
    """Pairing's loads as the daemon learns them: as `history_activity`, with GRACT."""
    profile, learnt = loads(workload_of), history_learnt(tasks)
    return lambda task: profile(task) if learnt(task) else None


def history_learnt(tasks: Callable[[], Iterable[Task]]) -> Callable[[Task], bool]:
    """Whether a run of the task's workload completed in this simulation with its GPUs to itself."""
    known: set[str] = set()
    checked: set[TaskId] = set()  # completed runs found shared: they never become alone

    def learnt(task: Task) -> bool:
        name = task.spec.name
        if name not in known:
            everything = list(tasks())
            for done in everything:
                if done.spec.name != name or done.state is not TaskState.COMPLETED or done.id in checked:
                    continue
                checked.add(done.id)
                if _alone(done, everything):
                    known.add(name)
                    break
        return name in known

    return learnt


def _alone(done: Task, everything: Iterable[Task]) -> bool:
    """Whether `done`'s last attempt (its successful run) had its GPUs to itself from launch to exit."""
    run = done.attempts[-1]
    return not any(other.id != done.id and _overlap(run, a) for other in everything for a in other.attempts)


def _overlap(run: Attempt, other: Attempt) -> bool:
    assert run.ended_s is not None
    ends = other.ended_s if other.ended_s is not None else float("inf")
    return bool(set(run.gpus) & set(other.gpus)) and other.dispatched_s < run.ended_s and ends > run.dispatched_s
