"""CARMA's trace-1 experiments on the twin: the paper's configuration list and its direction."""

import pytest

from carma.core import NeedKind, TaskSpec
from carma.core.types import MemoryNeed, Task
from carma.sim.experiment import PAPER_SWEEP, RecordedEstimator, RunConfig, TwinConfig, simulate, sweep
from carma.sim.gpus import parse_gpus
from carma.traces.catalog import Workload, load_catalog
from carma.traces.loaders import load_trace


@pytest.fixture(scope="module")
def t1():
    return load_trace("carma-t1", load_catalog())


@pytest.fixture(scope="module")
def t1_sweep(t1):
    return {r.config.label: r for r in sweep(t1, jobs=1)}


def test_the_sweep_is_the_papers_configuration_list():
    assert [c.label for c in PAPER_SWEEP] == [
        "Exclusive",
        "RR recovery only",
        "MAGM recovery only",
        "LUG recovery only",
        "FF oracle",
        "BF oracle",
        "MAGM oracle",
        "MAGM oracle, no risk filter",
        "LUG oracle",
        "MAGM Horus",
        "LUG Horus",
        "MAGM FakeTensor",
        "LUG FakeTensor",
        "MAGM GPUMemNet",
        "LUG GPUMemNet",
    ]


def test_every_collocating_configuration_finishes_t1_sooner_than_exclusive(t1_sweep):
    exclusive = t1_sweep["Exclusive"].metrics.makespan_s
    assert 9 * 3600 < exclusive < 12 * 3600  # about 10 GPU-server hours of work
    for label, result in t1_sweep.items():
        assert result.metrics.tasks_completed == 60, label
        if label != "Exclusive":
            assert result.metrics.makespan_s < exclusive, label


def test_oracle_runs_with_the_margin_have_no_oom_and_recovery_only_runs_recover(t1_sweep):
    for label, result in t1_sweep.items():
        if "oracle" in label or label == "Exclusive":
            assert result.metrics.oom_crashes == 0, label
    assert t1_sweep["RR recovery only"].metrics.oom_crashes > 0  # no preconditions at all


def test_collocation_raises_utilization_and_memory_use(t1_sweep):
    exclusive = t1_sweep["Exclusive"].metrics
    magm = t1_sweep["MAGM recovery only"].metrics
    assert magm.smact_mean > exclusive.smact_mean
    assert magm.mem_used_mean_mib > exclusive.mem_used_mean_mib
    assert magm.exec_p95_s > exclusive.exec_p95_s  # each task runs slower...
    assert magm.jct_p95_s < exclusive.jct_p95_s  # ...but waits far less


def test_sweep_results_do_not_depend_on_parallelism(t1, t1_sweep):
    runs = PAPER_SWEEP[:4]
    parallel = sweep(t1, runs, jobs=2)
    assert [r.row() for r in parallel] == [t1_sweep[c.label].row() for c in runs]


def test_recorded_estimator_answers_with_the_papers_estimates(t1):
    workloads = {e.workload.name: e.workload for e in t1.entries}

    def workload_of(task: Task) -> Workload:
        return workloads[task.spec.name]

    horus = RecordedEstimator("horus", workload_of)
    assert horus.need(Task(1, TaskSpec("vgg"), 0.0)) == MemoryNeed(NeedKind.KNOWN, 21526, "horus")
    bert = RecordedEstimator("faketensor", workload_of).need(Task(2, TaskSpec("BERT_base"), 0.0))
    assert bert.kind is NeedKind.WHOLE_GPU and bert.source == "faketensor: no usable estimate"


def test_recorded_xmem_estimates_of_multi_gpu_tasks_are_partial_as_the_servers_are(t1):
    """The server's capture of a job on several GPUs leaves out their communication, and holds its margin; the
    baselines' recorded estimates are CARMA's, placed as in CARMA's rows."""
    workloads = {e.workload.name: e.workload for e in t1.entries}

    def need(estimator: str, name: str, gpus: int) -> MemoryNeed:
        return RecordedEstimator(estimator, lambda task: workloads[task.spec.name]).need(
            Task(1, TaskSpec(name, gpus), 0.0)
        )

    assert need("xmem", "xlnet_large_cased_2", 2) == MemoryNeed(NeedKind.KNOWN, 17294, "xmem", partial=True)
    assert not need("horus", "xlnet_large_cased_2", 2).partial
    assert not need("xmem", "vgg", 1).partial


def test_each_trace_entry_is_placed_by_its_own_recorded_estimate(tmp_path):
    """Two entries of one task may record different estimates (its batch size changed): each is placed by
    its own. Here the later entry's small estimate must not let the earlier one share with the filler."""
    trace = tmp_path / "entries.csv"
    trace.write_text(
        "submit_s,task,solo_s,mem_mib,horus_mib\n0,filler,3000,20000,20000\n100,job,2000,30000,30000\n"
        "6000,job,2000,1000,1000\n"
    )
    one_gpu = TwinConfig(gpus=parse_gpus("1xA100-40GB"))
    result = simulate(load_trace(str(trace), load_catalog()), RunConfig("magm", "horus"), one_gpu)
    assert result.metrics.oom_crashes == 0
    assert [t.attempts[0].need.mib for t in result.tasks] == [20000, 30000, 1000]


def test_estimators_without_an_estimate_place_tasks_on_whole_gpus(t1):
    result = simulate(t1, RunConfig("magm", "faketensor"))
    bert = next(t for t in result.tasks if t.spec.name == "BERT_base")
    assert bert.attempts[0].need.kind.value == "whole_gpu"
    assert bert.attempts[0].exclusive


def test_activity_from_history_is_known_once_a_run_of_the_workload_completed_alone():
    """As the daemon learns it: a run that shared its GPU, or one still going, tells nothing."""
    from types import SimpleNamespace

    from carma.core.risk import Activity
    from carma.core.types import Attempt, ExitKind, TaskState
    from carma.sim.hints import history_activity

    def task(task_id: int, name: str, gpu: str, start: float, end: float | None) -> Task:
        t = Task(task_id, TaskSpec(name), start)
        outcome = ExitKind.SUCCESS if end is not None else None
        t.attempts.append(Attempt(1, (gpu,), start, exclusive=False, recovery=False, ended_s=end, outcome=outcome))
        t.state = TaskState.COMPLETED if end is not None else TaskState.RUNNING
        return t

    tasks = [task(1, "vgg", "g0", 0, 100), task(2, "mobilenet", "g0", 50, 150), task(3, "vgg", "g1", 120, None)]
    of = history_activity(lambda t: SimpleNamespace(smact=1.0, smocc=0.5, drama=0.6), lambda: tasks)
    asked = Task(9, TaskSpec("vgg"), 400)
    assert of(asked) is None  # the completed run shared g0 with mobilenet; the run on g1 has not ended
    tasks[2] = task(3, "vgg", "g1", 120, 300)
    assert of(asked) == Activity(1.0, 0.5, 0.6)
    assert of(Task(10, TaskSpec("mobilenet"), 400)) is None  # its only run shared g0


def test_pairing_cannot_tell_the_cost_beside_a_task_whose_load_is_not_known():
    """The pairing port over loads learnt from history: no cost where the task or a co-runner has none yet (the
    policy then ranks that GPU after those it can tell)."""
    from carma.sim.hints import pairing
    from carma.sim.models import Load, calibrated_interference

    known = {"vgg": Load(1.0, 1.0, 0.6, 0.8), "mobilenet": Load(0.3, 0.2, 0.1, 0.2)}
    cost = pairing(calibrated_interference(), "mps", lambda t: known.get(t.spec.name))
    vgg, mobilenet, new = (Task(i, TaskSpec(name), 0) for i, name in enumerate(("vgg", "mobilenet", "new")))
    assert cost(mobilenet, []) == 1.0
    assert 1.0 < cost(mobilenet, [mobilenet]) < cost(mobilenet, [vgg])
    assert cost(mobilenet, [new]) is None and cost(new, []) is None


def test_the_twin_learning_activity_as_the_daemon_does_is_its_own_configuration(t1):
    learnt = simulate(t1, RunConfig("magm", "oracle", own=True, activity="history"))
    assert learnt.config.label == "MAGM oracle, carma's own, activity from history"
    assert learnt.metrics.makespan_s != simulate(t1, RunConfig("magm", "oracle", own=True)).metrics.makespan_s
    with pytest.raises(ValueError, match="unknown activity source 'oracle'"):
        RunConfig("magm", activity="oracle")


def test_with_history_a_task_without_an_estimate_takes_the_peak_of_an_earlier_completed_run(tmp_path):
    """`xmem+history`: dlrm has no xMem estimate. Its first run and a second submitted while it runs take a whole
    GPU (no run had completed: causal, not an oracle); a third, after one completed, takes dlrm's peak and starts
    beside the filler, where with xMem alone it waits for the filler to end."""
    trace = tmp_path / "repeats.csv"
    trace.write_text(
        "submit_s,task,solo_s,mem_mib,xmem_mib\n0,dlrm,,,\n10,dlrm,,,\n5000,filler,6000,10000,10000\n5100,dlrm,,,\n"
    )
    one_gpu = TwinConfig(gpus=parse_gpus("1xA100-40GB"))
    runs = {
        memory: simulate(load_trace(str(trace), load_catalog()), RunConfig("magm", memory), one_gpu)
        for memory in ("xmem", "xmem+history")
    }
    history = runs["xmem+history"]
    assert history.config.label == "MAGM xMem + history" and history.row()["memory"] == "xmem+history"
    first, second, filler, third = history.tasks
    assert [t.attempts[0].need.source for t in (first, second)] == ["xmem: no usable estimate"] * 2
    assert third.attempts[0].need == MemoryNeed(NeedKind.KNOWN, 1468, "history")
    filler_end = filler.attempts[0].ended_s
    assert third.attempts[0].dispatched_s < filler_end
    alone = runs["xmem"].tasks[3].attempts[0]
    assert alone.need.kind is NeedKind.WHOLE_GPU and alone.dispatched_s >= runs["xmem"].tasks[2].attempts[0].ended_s
    assert all(run.metrics.oom_crashes == 0 for run in runs.values())
