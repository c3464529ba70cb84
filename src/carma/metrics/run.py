"""Run metrics (CARMA paper, section 3.1) from a run's tasks and per-GPU timelines.

- makespan: first submission to the last task's end;
- waiting time: time queued (first queueing and any recovery queueing); execution time: time from
  dispatch to exit, summed over attempts; JCT: submission to completion (= waiting + execution).
  Means and p95 are over completed tasks, and None (not measured, not zero) when no task completed;
- energy: integral of board power over the makespan, summed over GPUs (the difference of the on-device
  energy counters at start and end, as the paper reads it), in MJ; per completed task: that energy over the
  completed tasks, in kJ (None when none completed: a failed task's energy buys nothing);
- SMACT, SMOCC, DRAMA, memory used, power: time-weighted means over the makespan, averaged over GPUs;
- OOM crashes: attempts that ended out of memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from carma.core.types import Task, TaskState
from carma.metrics.timeline import Segment, integrate, time_mean


@dataclass(frozen=True)
class RunMetrics:
    makespan_s: float
    energy_mj: float
    energy_per_task_kj: float | None
    oom_crashes: int
    wait_mean_s: float | None
    wait_p95_s: float | None
    exec_mean_s: float | None
    exec_p95_s: float | None
    jct_mean_s: float | None
    jct_p95_s: float | None
    smact_mean: float
    smocc_mean: float
    drama_mean: float
    mem_used_mean_mib: float
    power_mean_w: float
    tasks_completed: int
    tasks_failed: int
    tasks_cancelled: int


NOT_MEASURED = "–"  # how tables show a figure no task measured (none completed): never as 0


def exec_s(task: Task) -> float:
    return sum(a.ended_s - a.dispatched_s for a in task.attempts if a.ended_s is not None)


def mean_p95(values: list[float]) -> tuple[float, float] | tuple[None, None]:
    """Mean and p95 (linear interpolation, as docs/metrics.md defines them); None when there is nothing."""
    if not values:
        return None, None
    return float(np.mean(values)), float(np.percentile(values, 95))


def compute_metrics(tasks: Sequence[Task], timelines: Sequence[Sequence[Segment]]) -> RunMetrics:
    if not tasks:
        raise ValueError("no tasks to measure")
    start = min(t.submit_s for t in tasks)
    end = max(t.ended_s for t in tasks if t.ended_s is not None)
    done = [t for t in tasks if t.state is TaskState.COMPLETED]
    jct = [t.ended_s - t.submit_s for t in done]
    execution = [exec_s(t) for t in done]
    wait = [j - e for j, e in zip(jct, execution, strict=True)]
    energy_j = sum(integrate(s, "power_w", start, end) for s in timelines)
    (wait_mean, wait_p95), (exec_mean, exec_p95), (jct_mean, jct_p95) = map(mean_p95, (wait, execution, jct))
    return RunMetrics(
        makespan_s=end - start,
        energy_mj=energy_j / 1e6,
        energy_per_task_kj=energy_j / 1e3 / len(done) if done else None,
        oom_crashes=sum(1 for t in tasks for a in t.attempts if a.out_of_memory),
        wait_mean_s=wait_mean,
        wait_p95_s=wait_p95,
        exec_mean_s=exec_mean,
        exec_p95_s=exec_p95,
        jct_mean_s=jct_mean,
        jct_p95_s=jct_p95,
        smact_mean=time_mean(timelines, "smact", start, end),
        smocc_mean=time_mean(timelines, "smocc", start, end),
        drama_mean=time_mean(timelines, "drama", start, end),
        mem_used_mean_mib=time_mean(timelines, "used_mib", start, end),
        power_mean_w=time_mean(timelines, "power_w", start, end),
        tasks_completed=len(done),
        tasks_failed=sum(1 for t in tasks if t.state is TaskState.FAILED),
        tasks_cancelled=sum(1 for t in tasks if t.state is TaskState.CANCELLED),
    )
