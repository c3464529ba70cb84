"""Run metrics as CARMA defines them."""

import os
import re

import numpy as np
import pytest

from carma.core import ExitKind, TaskSpec, TaskState
from carma.core.types import Attempt, Task
from carma.metrics.run import compute_metrics
from carma.metrics.timeline import Segment, integrate, time_mean


def seg(t, smact=0.0, used=0, power=50.0):
    return Segment(t, smact, 0.0, 0.0, used, power, 0)


def test_integrate_a_step_function_over_a_window():
    steps = [seg(0, smact=0.0), seg(10, smact=1.0), seg(20, smact=0.5)]
    assert integrate(steps, "smact", 0, 30) == pytest.approx(10 + 5)
    assert integrate(steps, "smact", 15, 25) == pytest.approx(5 + 2.5)
    assert integrate(steps, "smact", 40, 50) == pytest.approx(5)  # the last step holds on
    assert time_mean([steps, [seg(0, smact=1.0)]], "smact", 0, 30) == pytest.approx((15 / 30 + 1) / 2)


def task(id_, submit, attempts, state=TaskState.COMPLETED):
    t = Task(id_, TaskSpec(f"t{id_}"), submit, state=state)
    for number, (start, end, outcome) in enumerate(attempts, start=1):
        t.attempts.append(Attempt(number, (0,), start, exclusive=True, recovery=number > 1))
        t.attempts[-1].ended_s, t.attempts[-1].outcome = end, outcome
    t.ended_s = attempts[-1][1]
    return t


def test_waiting_execution_and_completion_times():
    tasks = [
        task(1, 0, [(0, 100, ExitKind.SUCCESS)]),
        # crashed after 10 s, waited 40 s in the recovery queue, then ran 100 s
        task(2, 10, [(30, 40, ExitKind.OOM), (80, 180, ExitKind.SUCCESS)]),
        task(3, 20, [(50, 60, ExitKind.ERROR)], TaskState.FAILED),
    ]
    m = compute_metrics(tasks, [[seg(0, power=100.0)]])
    assert m.makespan_s == 180
    assert m.exec_mean_s == pytest.approx((100 + 110) / 2)
    assert m.wait_mean_s == pytest.approx((0 + 60) / 2)  # 20 s queued + 40 s awaiting recovery
    assert m.jct_mean_s == pytest.approx((100 + 170) / 2)
    assert m.jct_p95_s == pytest.approx(np.percentile([100, 170], 95))
    assert m.oom_crashes == 1
    assert (m.tasks_completed, m.tasks_failed, m.tasks_cancelled) == (2, 1, 0)
    assert m.energy_mj == pytest.approx(100.0 * 180 / 1e6)
    assert m.energy_per_task_kj == pytest.approx(100.0 * 180 / 1e3 / 2)  # the failed task's share is the others'


def test_no_tasks_is_an_error():
    with pytest.raises(ValueError):
        compute_metrics([], [])


def test_a_run_where_no_task_completed_measures_no_completion_time():
    m = compute_metrics([task(1, 0, [(0, 10, ExitKind.OOM)], TaskState.FAILED)], [[seg(0)]])
    assert (m.wait_mean_s, m.wait_p95_s, m.exec_mean_s, m.exec_p95_s, m.jct_mean_s, m.jct_p95_s) == (None,) * 6
    assert m.energy_per_task_kj is None  # energy spent, but no task to divide it by
    assert (m.makespan_s, m.oom_crashes, m.tasks_failed) == (10, 1, 1)


# --- the tables `carma simulate` prints -------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_task_runs():
    """Exclusive and RR on a one-task trace: a 35-minute makespan."""
    from carma.sim.experiment import RunConfig, simulate
    from carma.traces.catalog import load_catalog
    from carma.traces.loaders import Trace, TraceEntry

    trace = Trace("one", (TraceEntry(0.0, load_catalog()["resnet"]),))
    return [simulate(trace, RunConfig(policy)) for policy in ("exclusive", "rr")]


def _printed(table) -> str:
    from rich.console import Console

    console = Console(width=300, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(table)
    return console.export_text()


def test_a_short_run_s_makespan_is_in_minutes(one_task_runs):
    from carma.reports.tables import run_table, sweep_table

    assert re.search(r"│ makespan +│ +35.0 min │", _printed(run_table(one_task_runs[0], "t")))
    assert "makespan min" in _printed(sweep_table(one_task_runs, "t"))  # "0.58 h" before


def test_a_change_that_rounds_to_zero_is_printed_plus_zero(one_task_runs):
    """-0.3% was "-0%"."""
    from dataclasses import replace

    from carma.reports.tables import sweep_table

    base, run = one_task_runs
    shorter = replace(run, metrics=replace(run.metrics, makespan_s=base.metrics.makespan_s * 0.997))
    text = _printed(sweep_table([base, shorter], "t"))
    assert "-0%" not in text and "34.9 +0%" in text.split("RR")[1]
