"""Dynamic MIG in the daemon (`carma server --mig dynamic`) on fake GPUs made with MIG mode enabled: tasks get
the tightest instance their need holds, reconfigurations are journaled and a killed one is finished at the next
start, a refused step loses nothing, every reconfiguration is kept for the dashboard's timeline, and the fake
GPUs refuse what NVML refuses."""

from __future__ import annotations

import json
import os
import re

import pytest

from carma.core import SchedulerConfig, TaskState
from carma.core.mig.scheduling import MigConfig
from carma.core.types import MigSlot, Reconfigure
from carma.server.client import run_figures
from carma.server.daemon import Daemon
from carma.server.dashboard import timeline_view
from carma.server.metrics import Metrics, counted
from carma.server.mig import JOURNAL
from carma.server.paths import Paths
from carma.server.spec import JobSpec
from carma.server.store import Store
from carma.server.views import task_view
from carma.sim.gpus import parse_gpus
from carma.telemetry.fake import FakeDevice, FakeGpuBackend, fake_env
from carma.telemetry.fakemig import FakeMigControl
from carma.telemetry.mig import MigError
from servers import fakejob
from support import cli_env, run_carma, step_until, wait_until


@pytest.fixture
def home(tmp_path):
    paths = Paths(tmp_path / "home")
    paths.create()
    FakeDevice.create(paths.fake_gpus, parse_gpus("1xA100-40GB"), time_scale=20.0, mig=True)
    return paths


def mig_daemon(
    paths: Paths,
    control: FakeMigControl | None = None,
    config: SchedulerConfig | None = None,
    keep_ended_s: float | None = None,
) -> Daemon:
    backend = FakeGpuBackend(paths.fake_gpus)
    control = control or FakeMigControl(backend.device)
    return Daemon(
        paths,
        backend,
        config or SchedulerConfig(),
        20.0,
        fake_env(paths.fake_gpus),
        mig=MigConfig("dynamic"),
        mig_control=control,
        keep_ended_s=keep_ended_s,
    )


def job(mem: str, mem_mib: int, seconds: float = 20) -> JobSpec:
    return JobSpec("job", tuple(fakejob(seconds, mem)), "/tmp", mem_mib=mem_mib)


def layout(device: FakeDevice) -> list[str]:
    gpu = device.uuid(0)
    return sorted(f"{i['profile']}@{i['start']}" for i in device.layout()[gpu])


def test_each_task_runs_on_the_tightest_instance_its_need_holds(home):
    d = mig_daemon(home)
    assert [g.slot for g in d.gpus] == [MigSlot("7g.40gb", 0)]  # a GPU without instances gets its largest
    small, large = d.submit(job("3GiB", 3072)), d.submit(job("15GiB", 15360))
    tasks = (small, large)
    step_until(d, lambda: all(d.scheduler.task(t.id).state is TaskState.RUNNING for t in tasks))
    profiles = {}
    for t in tasks:
        (target,) = d.scheduler.task(t.id).attempts[0].gpus
        profiles[t.id] = d.scheduler.gpus[target].slot.profile
    # 3 GiB and the 2 GiB margin need 2 memory slices (a 1g.5gb holds 4.75 GiB), 15 GiB and the margin 4; of those
    # sizes, where the most layouts stay open, then the most compute
    assert profiles == {small.id: "1g.10gb", large.id: "4g.20gb"}
    step_until(d, lambda: all(d.scheduler.task(t.id).state is TaskState.COMPLETED for t in tasks))
    assert d.mig is not None and d.mig.reconfigurations == 2
    assert 'carma_mig_reconfigurations_total{outcome="done"} 2.0' in Metrics(d).render().decode()
    assert d.store.meta(JOURNAL) is None
    d.close()


def test_a_task_predicted_to_outgrow_its_instance_is_restarted_early_on_a_larger_one(home):
    """Its history (an earlier successful run of the same command) gives the prediction its horizon; the fit
    leaves out a monitoring window after its first kernel (5 s here: the job grows for a minute)."""
    d = mig_daemon(home, config=SchedulerConfig(window_samples=5))
    growing = (*fakejob(60, "3GiB"), "--grow-to", "12GiB")
    first = d.submit(JobSpec("grows", growing, "/tmp", mem_mib=11 * 1024))  # room enough: its run time is learnt
    step_until(d, lambda: d.scheduler.task(first.id).state is TaskState.COMPLETED)
    assert d.hints.duration(d.scheduler.task(first.id)) is not None
    second = d.submit(JobSpec("grows", growing, "/tmp", mem_mib=3 * 1024))  # declared too low: a 1g.10gb
    step_until(d, lambda: d.scheduler.task(second.id).state is TaskState.COMPLETED, timeout=40)
    attempts = d.scheduler.task(second.id).attempts
    assert len(attempts) == 2 and attempts[0].message.startswith("restarted early")
    assert not any("out of memory" in (a.message or "") for a in attempts)
    # no crash in the counters and reports an operator reads (they counted it as one)
    assert counted(d.scheduler.tasks)["oom_crashes"] == 0
    shown = task_view(d, d.scheduler.task(second.id))
    assert [a["restarted_early"] for a in shown["attempt_list"]] == [True, False]
    assert run_figures([shown])["oom_crashes"] == 0
    (target,) = attempts[1].gpus
    assert d.mig.geometries[d.gpus[0].parent].profile(d.scheduler.gpus[target].slot.profile).memory_mib >= 12 * 1024
    d.close()


class Killed(BaseException):
    """The daemon killed in the middle of a reconfiguration (nothing after it runs)."""


class KilledAfterCreatingGpuInstance(FakeMigControl):
    def create_compute_instance(self, gpu: str, gi_id: int, compute_slices: int) -> int:
        raise Killed


def test_a_reconfiguration_killed_midway_is_finished_at_the_next_start(home):
    device = FakeDevice.open(home.fake_gpus)
    first = mig_daemon(home)
    first.mig.control = KilledAfterCreatingGpuInstance(device)
    gpu = device.uuid(0)
    with pytest.raises(Killed):
        first.mig.reconfigure(Reconfigure(gpu, (MigSlot("7g.40gb", 0),), (MigSlot("3g.20gb", 4),)))
    assert first.store.meta(JOURNAL) is not None
    assert layout(device) == ["3g.20gb@4"] and device.gpus() == []  # a GPU instance without its compute instance
    first.store.close()

    second = mig_daemon(home)  # its start finishes what the first meant
    assert second.store.meta(JOURNAL) is None
    assert [g.slot for g in second.gpus] == [MigSlot("3g.20gb", 4)]
    interrupted = reconfigurations(second)[-1]  # in the timeline, with what the start did
    assert (interrupted["outcome"], interrupted["created"]) == ("interrupted", ["3g.20gb@4"])
    assert (
        interrupted["reason"]
        == "under way when the daemon stopped; at its next start: finished creating MIG instance 3g.20gb@4"
    )
    task = second.submit(job("3GiB", 3072, seconds=5))
    step_until(second, lambda: second.scheduler.task(task.id).state is TaskState.COMPLETED)
    second.close()


def test_a_daemon_killed_as_it_gives_a_bare_mig_gpu_its_first_instance_finishes_it_at_the_next_start(home):
    """A GPU instance left without its compute instance is an instance all the same: unjournaled, the next start
    found the GPU partitioned, never completed it, and no task could run on that GPU again."""
    device = FakeDevice.open(home.fake_gpus)
    with pytest.raises(Killed):
        mig_daemon(home, control=KilledAfterCreatingGpuInstance(device))
    assert layout(device) == ["7g.40gb@0"] and device.gpus() == []

    again = mig_daemon(home)
    assert [g.slot for g in again.gpus] == [MigSlot("7g.40gb", 0)]
    assert again.store.meta(JOURNAL) is None
    (interrupted,) = reconfigurations(again)
    assert (interrupted["outcome"], interrupted["created"]) == ("interrupted", ["7g.40gb@0"])
    assert interrupted["reason"].endswith("finished creating MIG instance 7g.40gb@0")
    task = again.submit(job("3GiB", 3072, seconds=5))
    step_until(again, lambda: again.scheduler.task(task.id).state is TaskState.COMPLETED)
    again.close()


class RefusingGpuInstances(FakeMigControl):
    def create_gpu_instance(self, gpu: str, profile_id: int, start: int) -> int:
        raise MigError("Insufficient Resources")


def test_a_daemon_whose_bare_mig_gpus_refuse_their_first_instance_stops_saying_so_and_keeps_the_refusal(home):
    with pytest.raises(RuntimeError, match=r"^--mig dynamic: no MIG GPU has an instance to run tasks on \(GPU .*: "
                       r"no MIG instance, and 7g.40gb could not be created: no task runs on it\)$"):  # fmt: skip
        mig_daemon(home, control=RefusingGpuInstances(FakeDevice.open(home.fake_gpus)))
    store = Store(home.database, readonly=True)
    try:
        assert store.meta(JOURNAL) is None
        (r,) = store.reconfigurations(0.0)
        assert (r.created, r.outcome, r.reason) == (("7g.40gb@0",), "refused", "Insufficient Resources")
    finally:
        store.close()


def test_a_daemon_killed_as_it_ends_a_reconfiguration_keeps_it_once(home, monkeypatch):
    """Killed at the write that clears the journal, after the last step: the next start must not find it journaled
    beside a record saying it was done (one reconfiguration, two marks in the timeline)."""
    first = mig_daemon(home)
    gpu = first.gpus[0].parent
    write = Store._set_meta

    def killed_at_clearing(db, key, value):  # type: ignore[no-untyped-def]
        if key == JOURNAL and value is None:
            raise Killed
        write(db, key, value)

    monkeypatch.setattr(Store, "_set_meta", staticmethod(killed_at_clearing))
    with pytest.raises(Killed):
        first.mig.reconfigure(Reconfigure(gpu, (MigSlot("7g.40gb", 0),), (MigSlot("3g.20gb", 4),)))
    monkeypatch.setattr(Store, "_set_meta", staticmethod(write))
    first.store.close()

    second = mig_daemon(home)
    assert second.store.meta(JOURNAL) is None
    made = [r for r in reconfigurations(second) if r["created"] == ["3g.20gb@4"]]
    assert [(r["outcome"], r["reason"]) for r in made] == [
        ("interrupted", "under way when the daemon stopped; at its next start: nothing left half-made")
    ]
    second.close()


def test_a_step_the_gpu_refuses_ends_the_reconfiguration_consistent(home, caplog):
    d = mig_daemon(home)
    device, gpu = d.backend.device, d.gpus[0].parent
    whole = d.gpus[0].id
    assert device.allocate(os.getpid(), [whole], 1024) == (True, "")  # a process carma did not start
    try:
        d.mig.reconfigure(Reconfigure(gpu, (MigSlot("7g.40gb", 0),), (MigSlot("1g.5gb", 0),)))
    finally:
        device.release(os.getpid())
    assert d.mig.refused == 1 and d.mig.reconfigurations == 0
    assert layout(device) == ["7g.40gb@0"]
    assert d.store.meta(JOURNAL) is None
    assert "in use: a process runs on it" in caplog.text
    d.close()


def reconfigurations(d: Daemon) -> list[dict]:
    """The reconfigurations of the dashboard's timeline over the last day, as the API sends them."""
    return json.loads(json.dumps(timeline_view(d, d.clock.now() - 86400, [])["reconfigurations"]))


def test_every_reconfiguration_is_in_the_timeline_refused_ones_too_and_after_a_restart(home):
    d = mig_daemon(home)
    gpu, whole = d.gpus[0].parent, d.gpus[0].id
    (at_start,) = reconfigurations(d)
    assert at_start["gpu"] == gpu and (at_start["destroyed"], at_start["created"]) == ([], ["7g.40gb@0"])
    assert (at_start["outcome"], at_start["reason"]) == ("done", "at the daemon's start: the GPU had no MIG instance")
    device = d.backend.device
    assert device.allocate(os.getpid(), [whole], 1024) == (True, "")  # a process carma did not start
    try:
        d.mig.reconfigure(Reconfigure(gpu, (MigSlot("7g.40gb", 0),), (MigSlot("1g.5gb", 0),)))
    finally:
        device.release(os.getpid())
    task = d.submit(job("3GiB", 3072, seconds=5))
    step_until(d, lambda: d.scheduler.task(task.id).state is TaskState.COMPLETED)
    (instance,) = d.scheduler.task(task.id).attempts[0].gpus
    _, refused, done = seen = reconfigurations(d)
    assert (refused["destroyed"], refused["created"], refused["outcome"]) == (["7g.40gb@0"], ["1g.5gb@0"], "refused")
    assert "in use: a process runs on it" in refused["reason"]
    assert (done["gpu"], done["destroyed"], done["outcome"], done["reason"]) == (gpu, ["7g.40gb@0"], "done", None)
    assert done["created"] == [str(d.scheduler.gpus[instance].slot)]  # the instance the task then ran on
    dispatched = d.scheduler.task(task.id).attempts[0].dispatched_s
    assert at_start["t_s"] <= refused["t_s"] <= done["t_s"] <= dispatched
    d.close()

    again = mig_daemon(home)  # the store keeps them; the layout needs nothing at this start
    assert reconfigurations(again) == seen
    assert [r["t_s"] for r in timeline_view(again, done["t_s"], [])["reconfigurations"]] == [
        done["t_s"]
    ]  # in the window
    again.close()


def test_reconfigurations_are_kept_as_long_as_ended_tasks(home):
    d = mig_daemon(home, keep_ended_s=1.0)  # a clock second: 50 ms at the fake GPUs' 20x
    (at_start,) = reconfigurations(d)
    wait_until(lambda: d.clock.now() > at_start["t_s"] + 1.0, 5, "a clock second")
    gpu = d.gpus[0].parent
    d.mig.reconfigure(Reconfigure(gpu, (MigSlot("7g.40gb", 0),), (MigSlot("3g.20gb", 4),)))
    assert [r["created"] for r in reconfigurations(d)] == [["3g.20gb@4"]]
    d.close()


def test_a_mig_instance_reads_no_energy_as_nvml_gives_it_none(home):
    """The fake backend counted 0 J for it: `/metrics` and reports showed 0 energy, not "not measured"."""
    d = mig_daemon(home)
    (instance,) = d.backend.read(d.clock.now())
    assert d.gpus[0].slot is not None and instance.sample.gpu == d.gpus[0].id
    assert (instance.sample.power_w, instance.sample.energy_j) == (None, None)
    d.close()


def test_fake_mig_gpus_refuse_what_nvml_refuses(home):
    device = FakeDevice.open(home.fake_gpus)
    control = FakeMigControl(device)
    gpu = device.uuid(0)
    with pytest.raises(MigError, match="not a placement or profile this GPU allows"):
        control.create_gpu_instance(gpu, 9, 2)  # a 3g.20gb starts at slice 0 or 4
    control.create_gpu_instance(gpu, 9, 4)
    with pytest.raises(MigError, match="memory slices are taken"):
        control.create_gpu_instance(gpu, 14, 4)  # a 2g.10gb over the 3g.20gb's slices
    gi = control.create_gpu_instance(gpu, 14, 0)
    control.create_compute_instance(gpu, gi, 2)
    (instance,) = (t for t in device.gpus() if t.slot == MigSlot("2g.10gb", 0))
    assert device.allocate(os.getpid(), [instance.id], 2048) == (True, "")
    try:
        with pytest.raises(MigError, match="in use"):
            control.destroy_gpu_instance(gpu, gi)
        ok, message = device.allocate(os.getpid(), [instance.id], 12 * 1024)  # more than its 9.6 GiB
        assert not ok and "CUDA out of memory" in message
    finally:
        device.release(os.getpid())
    control.destroy_gpu_instance(gpu, gi)
    assert [v.start for v in control.gpu_instances(gpu)] == [4]


def test_a_daemon_without_mig_gpus_refuses_dynamic_mig_in_one_line(tmp_path):
    paths = Paths(tmp_path / "home")
    paths.create()
    FakeDevice.create(paths.fake_gpus, parse_gpus("1xA100-40GB"))
    with pytest.raises(RuntimeError, match=r"no GPU here has MIG mode enabled \(an admin enables it"):
        mig_daemon(paths)


def test_carma_server_mig_dynamic_through_the_cli(start_server):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB", "--fake-mig", "--mig", "dynamic", "--time-scale", "50")
    small = server.submit(*fakejob(100000, "3GiB"), mem="3GiB")
    large = server.submit(*fakejob(100000, "15GiB"), mem="15GiB")
    server.wait_state(small, "running")
    server.wait_state(large, "running")
    gpus = {g["slot"]: g for g in server.json("gpus")}
    assert gpus["1g.10gb@6"]["tasks"] == [small] and gpus["4g.20gb@0"]["tasks"] == [large]
    listing = server.cli("gpus").stdout
    layout = next(line for line in listing.splitlines() if line.startswith("MIG "))
    assert re.search(
        r"4g\.20gb@0 \(GPU \d, task \d\), 1g\.10gb@6 \(GPU \d, task \d\); free memory slices 4, 5$", layout
    )
    assert "on MIG instance 1g.10gb@6 of GPU-fake-0-" in server.cli("show", small).stdout
    assert server.json("status")["mig"]["reconfigurations"] == 2
    assert "2 targets (MIG instances) on 1 GPU," in server.cli("status").stdout  # it said "2 GPUs" of one A100
    timeline = server.client.request("GET", "/v1/timeline", {"hours": 1})["reconfigurations"]
    made = [r for r in timeline if r["reason"] is None]
    assert [r["outcome"] for r in made] == ["done", "done"]
    assert {s for r in made for s in r["created"]} >= {"4g.20gb@0", "1g.10gb@6"}


def test_dynamic_mig_on_gpus_without_mig_mode_is_refused_in_one_line(tmp_path):
    env = cli_env(CARMA_HOME=str(tmp_path / "h"))
    result = run_carma("server", "--fake-gpus", "1xA100-40GB", "--mig", "dynamic", env=env)
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "no GPU here has MIG mode enabled" in result.stderr
