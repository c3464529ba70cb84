"""The twin with dynamic MIG GPUs: instances as targets, speed on an instance, reconfiguration time, and the
figures `carma simulate --mig dynamic` adds."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from carma.core.mig.geometry import Geometry
from carma.core.types import TaskState
from carma.sim.experiment import RunConfig, TwinConfig, best_static, simulate, static_layouts
from carma.sim.gpus import parse_gpus
from carma.sim.migspeed import speed_on
from carma.sim.migtwin import full_layouts, parse_layout
from carma.traces.catalog import load_catalog
from carma.traces.loaders import Trace, TraceEntry
from support import run_carma

A100 = TwinConfig(gpus=parse_gpus("1xA100-40GB"))


def trace(*names: str, at: float = 0.0) -> Trace:
    catalog = load_catalog()
    return Trace("test", tuple(TraceEntry(at, catalog[n]) for n in names))


def profile_of(target: str) -> str:
    return target.split("/")[1].split("@")[0]


@pytest.mark.parametrize("scheme", ["a", "b"])
def test_every_task_runs_on_the_tightest_instance_that_holds_its_need_with_the_margin(scheme):
    result = simulate(
        trace("resnet", "vgg", "BERT_large", "resnet"), RunConfig("magm", "oracle", mig="dynamic", scheme=scheme), A100
    )
    assert all(t.state is TaskState.COMPLETED for t in result.tasks)
    placed = {t.spec.name: profile_of(t.attempts[-1].gpus[0]) for t in result.tasks}
    # needs plus the 2 GiB margin: 5982, 8732 and 14670 MiB: two memory slices, two and four
    assert placed == {"resnet": "2g.10gb", "vgg": "2g.10gb", "BERT_large": "4g.20gb"}
    assert result.reconfigurations and result.row()["reconfigurations"] == result.reconfigurations


def test_a_job_alone_on_a_small_instance_runs_at_its_modelled_speed():
    catalog = load_catalog()
    job = catalog["resnet"]
    result = simulate(trace("resnet"), RunConfig("magm", "oracle", mig="dynamic"), A100)
    (task,) = result.tasks
    attempt = task.attempts[0]
    ran_s = task.ended_s - attempt.dispatched_s
    geometry = Geometry.of("A100-40GB")
    speed = speed_on(job, geometry.profile("1g.10gb"), geometry)  # at 6, where the most layouts stay open
    start_s = job.ttfk_s + job.warmup_s
    assert ran_s == pytest.approx(start_s + (job.solo_s - start_s) / speed, rel=1e-6)
    assert speed < 1  # slower than on the whole GPU: the instance has 1 of 7 compute slices, 2 of 8 memory


def test_a_task_waits_for_its_instance_while_it_is_being_made():
    result = simulate(trace("resnet"), RunConfig("magm", "oracle", mig="dynamic"), A100)
    (task,) = result.tasks
    # the 7g.40gb is destroyed and a 1g.10gb created: 2 steps of 1 s, then the next 1 Hz reading
    assert task.attempts[0].dispatched_s >= 2.0 and result.reconfigurations == 1


def test_a_longer_reconfiguration_step_delays_the_task_by_its_steps():
    run = RunConfig("magm", "oracle", mig="dynamic")
    default = simulate(trace("resnet"), run, A100)
    slow = simulate(trace("resnet"), run, replace(A100, reconfiguration_s=5.0))
    (fast_task,), (slow_task,) = default.tasks, slow.tasks
    # two steps (the 7g.40gb destroyed, a 2g.10gb created) of 5 s instead of 1 s: 8 s later, start and end
    assert slow_task.attempts[0].dispatched_s - fast_task.attempts[0].dispatched_s == pytest.approx(8.0)
    assert slow_task.ended_s - fast_task.ended_s == pytest.approx(8.0)


def test_a_task_of_unknown_need_grows_through_the_profiles_after_ooms():
    result = simulate(trace("BERT_large"), RunConfig("magm", "none", mig="dynamic"), A100)
    (task,) = result.tasks
    assert task.state is TaskState.COMPLETED
    assert [profile_of(a.gpus[0]) for a in task.attempts] == ["1g.5gb", "2g.10gb", "4g.20gb"]


def test_simulate_mig_dynamic_prints_the_mig_figures_and_whole_gpu_runs_do_not():
    mig = run_carma(
        "simulate",
        "--gpus",
        "1xA100-40GB",
        "--mig",
        "dynamic",
        "--scheme",
        "a",
        "--memory",
        "oracle",
        "--limit",
        "5",
        "--json",
    )
    assert mig.returncode == 0, mig.stderr
    (row,) = json.loads(mig.stdout)["runs"]
    assert row["config"] == "MIG scheme A oracle" and row["reconfigurations"] >= 1
    assert row["early_restarts"] == 0 and row["throughput_tasks_per_h"] > 0
    whole = run_carma("simulate", "--gpus", "1xA100-40GB", "--limit", "5", "--json")
    assert "reconfigurations" not in json.loads(whole.stdout)["runs"][0]
    table = run_carma(
        "simulate", "--gpus", "1xA100-40GB", "--mig", "dynamic", "--scheme", "a", "--memory", "oracle", "--limit", "5"
    )
    assert re.search(rf"MIG reconfigurations\s+│\s+{row['reconfigurations']} ", table.stdout), table.stdout


def test_simulate_refuses_a_sweep_with_mig_and_an_unknown_scheme():
    sweep = run_carma("simulate", "--sweep", "--mig", "dynamic")
    assert sweep.returncode != 0 and "drop --mig" in sweep.stderr
    bad = run_carma("simulate", "--mig", "dynamic", "--scheme", "c")
    assert bad.returncode != 0 and "--scheme must be one of a, b" in bad.stderr


def growing_llm() -> Trace:
    """A BERT-large-shaped job declared at 7.5 GB that grows to MIGM's Qwen2-7B peak, 12.23 GB, by its end."""
    bert = load_catalog()["BERT_large"]
    llm = replace(bert, name="llm", mem_mib=7500, mem_first_mib=min(bert.mem_first_mib, 7500))
    return Trace("growing", (TraceEntry(0.0, llm),))


@pytest.mark.parametrize("predict", [True, False])
def test_a_growing_task_restarts_early_with_prediction_and_crashes_without(predict):
    run = RunConfig("magm", "oracle", mig="dynamic", predict=predict)
    result = simulate(growing_llm(), run, A100, growing={"llm": 12230})
    (task,) = result.tasks
    assert task.state is TaskState.COMPLETED
    assert [profile_of(a.gpus[0]) for a in task.attempts] == ["1g.10gb", "4g.20gb"]  # 9548 MiB with the margin
    row = result.row()
    first = task.attempts[0]
    if predict:
        assert row["early_restarts"] == 1 and row["oom_crashes"] == result.metrics.oom_crashes == 0
        assert [(a.restarted_early, a.out_of_memory) for a in task.attempts] == [(True, False), (False, False)]
        # restarted before its memory reached the 1g.10gb's 9856 MiB
        assert first.message.startswith("restarted early")
    else:
        assert row["early_restarts"] == 0 and row["oom_crashes"] == 1
        assert "out of memory" in first.message.lower()


# a full A100-40GB layout with three sizes: 3g.20gb (19968 MiB), 2g.10gb and 1g.10gb (9856 MiB each)
LAYOUT = parse_layout("3g.20gb@0,2g.10gb@4,1g.10gb@6")


def static(memory: str = "oracle") -> RunConfig:
    return RunConfig("magm", memory, mig="static", layout=(LAYOUT,))


def test_a_static_layout_is_never_reconfigured_and_runs_one_task_per_instance():
    result = simulate(trace("resnet", "vgg", "BERT_large", "resnet", "vgg"), static(), A100)
    assert all(t.state is TaskState.COMPLETED for t in result.tasks)
    assert result.reconfigurations == 0 and result.row()["layout"] == "3g.20gb@0,2g.10gb@4,1g.10gb@6"
    attempts = [a for t in result.tasks for a in t.attempts]
    assert {a.gpus[0] for a in attempts} <= {f"SIM-GPU-0/{slot}" for slot in LAYOUT}
    for a in attempts:  # never two tasks on one instance at a time
        assert not any(b is not a and b.gpus == a.gpus and b.dispatched_s < a.ended_s < b.ended_s for b in attempts)
    # best fit: the one task too large for a 10 GB instance (14670 MiB with the margin) takes the 3g.20gb
    bert = next(t for t in result.tasks if t.spec.name == "BERT_large")
    assert profile_of(bert.attempts[0].gpus[0]) == "3g.20gb"


def test_a_static_layout_relaunches_an_oom_crash_on_a_larger_instance():
    result = simulate(trace("BERT_large"), static("none"), A100)
    (task,) = result.tasks
    assert task.state is TaskState.COMPLETED and result.reconfigurations == 0
    assert [profile_of(a.gpus[0]) for a in task.attempts][-1] == "3g.20gb"
    assert len(task.attempts) == 2 and result.row()["oom_crashes"] == 1


def test_the_best_static_layout_is_a_full_layout_that_holds_every_task_and_beats_the_others():
    mix = trace("resnet", "resnet", "BERT_large", "vgg")
    best, tried = best_static(mix, A100)
    geometry = Geometry.of("A100-40GB")
    (layout,) = best.config.layout
    assert layout in full_layouts(geometry) and best.reconfigurations == 0
    assert tried == len(static_layouts(A100.gpus, 12622 + 2048)) and 1 < tried < len(geometry.layouts)
    assert all(t.state is TaskState.COMPLETED for t in best.tasks)
    whole = simulate(mix, RunConfig("magm", "oracle", mig="static", layout=(parse_layout("7g.40gb@0"),)), A100)
    assert best.metrics.makespan_s < whole.metrics.makespan_s


def test_simulate_mig_static_runs_a_layout_and_refuses_bad_ones_in_one_line():
    ok = run_carma("simulate", "--gpus", "1xA100-40GB", "--mig", "static", "--layout", "4g.20gb@0,3g.20gb@4",
                   "--memory", "oracle", "--limit", "4", "--json")  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    (row,) = json.loads(ok.stdout)["runs"]
    assert row["mig"] == "static" and row["reconfigurations"] == 0 and row["layout"] == "4g.20gb@0,3g.20gb@4"
    for args, said in [
        (["--layout", "4g.20gb@4"], "4g.20gb cannot start at memory slice 4"),
        (["--layout", "3g.20gb@0,4g.20gb@0"], "no layout of A100-40GB holds these instances"),
        (["--layout", "1g.5gb+me@0"], "not offered to tasks"),
        (["--layout", "4g.20gb"], "PROFILE@START"),
    ]:
        bad = run_carma("simulate", "--gpus", "1xA100-40GB", "--mig", "static", *args)
        assert bad.returncode != 0 and said in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    missing = run_carma("simulate", "--mig", "static")
    assert missing.returncode != 0 and "--mig static takes a --layout" in missing.stderr


def test_a_mig_run_is_saved_for_reports_its_attempts_on_the_gpus_that_hold_their_instances():
    """`--save` and `--plot` of a MIG run ended in `invalid literal for int()` (an instance's id read as a GPU
    index), after the simulation: a MIG run never reached `carma report`."""
    from carma.reports.record import from_run_result

    two = TwinConfig(gpus=parse_gpus("2xA100-40GB"))
    result = simulate(trace("resnet", "vgg", "BERT_large", "resnet"), RunConfig("magm", "oracle", mig="dynamic"), two)
    record = from_run_result(result)
    shown = {t.id: {g for a in t.attempts for g in a.gpus} for t in record.tasks}
    ran = {
        t.id: {int(g.split("/")[0].removeprefix("SIM-GPU-")) for a in t.attempts for g in a.gpus} for t in result.tasks
    }
    assert shown == ran and set().union(*shown.values()) <= {0, 1}


def test_a_task_no_instance_of_a_static_layout_holds_fails_saying_so_not_that_the_gpu_is_too_small():
    """`it needs more memory than the GPU has` on a 40 GB A100 whose layout was the limit."""
    run = RunConfig("magm", mig="static", layout=(parse_layout("1g.5gb@0"),))
    (task,) = simulate(trace("resnet2"), run, A100).tasks
    assert task.state is TaskState.FAILED
    assert task.reason.startswith("out of memory alone on MIG instance 0: it needs more memory than any instance")
