"""Fake GPUs: the device registry, its GPU model, the backend, and fake jobs as real subprocesses."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import pytest

from carma.core.recovery import classify_exit
from carma.core.types import ExitKind, ProcessExit
from carma.sim.gpus import parse_gpus
from carma.sim.models import Load, calibrated_interference, calibrated_power
from carma.telemetry import GpuProcess
from carma.telemetry.fake import FakeDevice, FakeGpuBackend, fake_env
from support import wait_until

A100 = parse_gpus("A100-40GB")[0]
TOTAL = A100.total_mib  # 40960 MiB
BUSY = Load(gract=0.9, smact=0.6, smocc=0.3, drama=0.5)
LIGHT = Load(gract=0.4, smact=0.3, smocc=0.1, drama=0.2)
SCALE = 20.0  # fake jobs run 20x faster than their simulated seconds


@pytest.fixture
def device(tmp_path: Path) -> FakeDevice:
    return FakeDevice.create(tmp_path / "dev", [A100, A100])


@pytest.fixture
def live_pids() -> Iterator[Callable[[], int]]:
    """Pids of real (sleeping) processes: the device forgets registrations of dead ones."""
    started: list[subprocess.Popen[bytes]] = []

    def spawn() -> int:
        started.append(subprocess.Popen(["sleep", "60"]))
        return started[-1].pid

    yield spawn
    for proc in started:
        proc.kill()
        proc.wait()


def uuids(device: FakeDevice) -> list[str]:
    return [g.id for g in device.gpus()]


def used(device: FakeDevice, uuid: str) -> int:
    return sum(mib for _, mib, _ in device.processes(uuid))


# ----------------------------------------------------------------- the device


def test_create_open_round_trip(tmp_path: Path) -> None:
    created = FakeDevice.create(tmp_path, parse_gpus("A100-40GB,H100-80GB"), sharing="timeslice", time_scale=60)
    opened = FakeDevice.open(tmp_path)
    assert opened.gpus() == created.gpus()
    assert [(g.name, g.total_mib) for g in opened.gpus()] == [("A100-40GB", 40960), ("H100-80GB", 81559)]
    assert all(g.id.startswith(f"GPU-fake-{i}-") for i, g in enumerate(opened.gpus()))
    assert (opened.sharing, opened.time_scale, opened.fragmentation) == ("timeslice", 60.0, 0.05)
    description = json.loads((tmp_path / "device.json").read_text())
    assert description["gpus"][1]["idle_w"] == 70.0 and description["gpus"][1]["max_w"] == 700.0
    assert created.index_of(created.gpus()[1].id) == 1
    with pytest.raises(ValueError, match="not a GPU"):
        created.index_of("GPU-fake-7-0000")


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"sharing": "mig"}, "sharing mode"),
        ({"time_scale": 0}, "time scale"),
        ({"fragmentation": 1.0}, "fragmentation"),
    ],
)
def test_create_rejects_bad_settings(tmp_path: Path, options: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        FakeDevice.create(tmp_path, [A100], **options)


def test_open_without_device_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no fake GPU device"):
        FakeDevice.open(tmp_path)


def test_allocate_grows_and_release_frees(device: FakeDevice, live_pids: Callable[[], int]) -> None:
    g0, g1 = uuids(device)
    a, b = live_pids(), live_pids()
    assert device.allocate(a, [g0], 512) == (True, "")
    assert device.allocate(a, [g0], 8192) == (True, "")
    assert device.allocate(b, [g0, g1], 4096) == (True, "")
    assert device.processes(g0) == [(a, 8192, None), (b, 4096, None)]
    assert device.processes(g1) == [(b, 4096, None)]
    device.release(a)
    assert used(device, g0) == 4096
    device.release(b)
    assert device.processes(g0) == device.processes(g1) == []


def test_allocation_across_gpus_is_all_or_nothing(device: FakeDevice, live_pids: Callable[[], int]) -> None:
    g0, g1 = uuids(device)
    hog, job = live_pids(), live_pids()
    assert device.allocate(hog, [g1], 36000)[0]
    ok, message = device.allocate(job, [g0, g1], 8192)
    assert not ok
    assert "GPU 1 has a total capacity of 40.00 GiB of which 4960 MiB is free" in message
    assert device.processes(g0) == []  # nothing kept on the GPU where it fitted


def test_fragmentation_allowance(device: FakeDevice, live_pids: Callable[[], int]) -> None:
    """A request that fits the raw free memory fails when it exceeds free less 5% of the co-runners' memory."""
    g0, _ = uuids(device)
    hog, job = live_pids(), live_pids()
    assert device.allocate(hog, [g0], 20480)[0]
    free, allowance = TOTAL - 20480, 0.05 * 20480  # 20480 free, 1024 kept back
    assert not device.allocate(job, [g0], free - 512)[0]
    assert device.allocate(job, [g0], int(free - allowance))[0]


def test_oom_message_is_pytorchs_and_classified_as_oom(device: FakeDevice, live_pids: Callable[[], int]) -> None:
    g0, _ = uuids(device)
    ok, message = device.allocate(live_pids(), [g0], 2 * TOTAL)
    assert not ok
    assert message == (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 80.00 GiB. "
        "GPU 0 has a total capacity of 40.00 GiB of which 40960 MiB is free."
    )
    assert classify_exit(ProcessExit(1, message)) == ExitKind.OOM


def test_dead_processes_are_forgotten(device: FakeDevice) -> None:
    """A SIGKILLed job cannot release: its registration goes when it dies, zombie or reaped."""
    g0, _ = uuids(device)
    zombie, reaped = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
    assert device.allocate(zombie.pid, [g0], 1024)[0] and device.allocate(reaped.pid, [g0], 2048)[0]
    assert used(device, g0) == 3072
    zombie.kill()
    reaped.kill()
    reaped.wait()
    wait_until(lambda: device.processes(g0) == [])
    assert list((device.root / "procs").glob("*.json")) == []
    assert device.sample(g0, 0.0).used_mib == 0
    zombie.wait()


# ----------------------------------------------------------------- the GPU model


def test_a_speed_asked_again_follows_every_change_of_the_registry(device: FakeDevice, live_pids) -> None:  # type: ignore[no-untyped-def]
    """A job's speed is worked out again only when the registry changed (N jobs asking 20 times a wall
    second each read all N files each time); a change by another process must show at once, and a
    co-runner killed without releasing once the daemon's next reading has removed it."""
    g0, _ = uuids(device)
    other = FakeDevice.open(device.root)  # another process's view of the device
    mine, killed = live_pids(), subprocess.Popen(["sleep", "60"])
    assert device.allocate(mine, [g0], 1024)[0]
    device.set_load(mine, BUSY)
    assert device.speed(mine) == 1.0
    assert other.allocate(killed.pid, [g0], 1024)[0]
    other.set_load(killed.pid, BUSY)
    assert device.speed(mine) < 1.0
    killed.kill()
    killed.wait()
    other.readings(0.0)  # the daemon reads every step
    assert device.speed(mine) == 1.0


@pytest.mark.parametrize("sharing", ["mps", "timeslice"])
def test_speed_and_sample_follow_the_calibrated_models(
    tmp_path: Path, live_pids: Callable[[], int], sharing: str
) -> None:
    device = FakeDevice.create(tmp_path, [A100], sharing=sharing)
    (g0,) = uuids(device)
    a, b = live_pids(), live_pids()
    assert device.allocate(a, [g0], 10000)[0] and device.allocate(b, [g0], 6000)[0]
    idle = device.sample(g0, 5.0)
    assert (idle.gpu, idle.t, idle.used_mib, idle.total_mib, idle.smact) == (g0, 5.0, 16000, TOTAL, 0.0)
    assert idle.power_w == pytest.approx(A100.idle_w)

    device.set_load(a, BUSY)
    assert device.speed(a) == 1.0 and device.speed(b) == 1.0
    alone = device.sample(g0, 6.0)
    assert (alone.smact, alone.smocc, alone.drama) == pytest.approx((0.6, 0.3, 0.5))
    assert alone.power_w == pytest.approx(calibrated_power().power_w(A100, 0.6))

    device.set_load(b, LIGHT)
    slow_a, slow_b = calibrated_interference().slowdowns([BUSY, LIGHT], sharing)
    assert slow_a > 1 and slow_b > 1
    assert device.speed(a) == pytest.approx(1 / slow_a) and device.speed(b) == pytest.approx(1 / slow_b)
    smact = 0.6 / slow_a + 0.3 / slow_b
    both = device.sample(g0, 7.0)
    assert both.smact == pytest.approx(smact)
    assert both.smocc == pytest.approx(0.3 / slow_a + 0.1 / slow_b)
    assert both.drama == pytest.approx(0.5 / slow_a + 0.2 / slow_b)
    assert both.power_w == pytest.approx(calibrated_power().power_w(A100, smact))


def test_mps_slows_collocated_jobs_less_than_timeslicing(tmp_path: Path, live_pids: Callable[[], int]) -> None:
    speeds = {}
    for sharing in ("mps", "timeslice"):
        device = FakeDevice.create(tmp_path / sharing, [A100], sharing=sharing)
        (g0,) = uuids(device)
        a, b = live_pids(), live_pids()
        for pid in (a, b):
            assert device.allocate(pid, [g0], 1024)[0]
            device.set_load(pid, BUSY)
        speeds[sharing] = device.speed(a)
    assert speeds["timeslice"] < speeds["mps"] < 1


def test_speed_is_set_by_the_most_crowded_gpu(device: FakeDevice, live_pids: Callable[[], int]) -> None:
    g0, g1 = uuids(device)
    wide, neighbour = live_pids(), live_pids()
    assert device.allocate(wide, [g0, g1], 1024)[0] and device.allocate(neighbour, [g1], 1024)[0]
    device.set_load(wide, BUSY)
    device.set_load(neighbour, BUSY)
    slowdown = calibrated_interference().slowdowns([BUSY, BUSY], "mps")[0]
    assert device.speed(wide) == pytest.approx(1 / slowdown)
    assert device.sample(g0, 0.0).smact == pytest.approx(BUSY.smact / slowdown)  # GPU 0 waits on GPU 1
    assert device.sample(g1, 0.0).smact == pytest.approx(min(1.0, 2 * BUSY.smact / slowdown))


def test_backend_reads_every_gpu_in_index_order(device: FakeDevice, live_pids: Callable[[], int]) -> None:
    _, g1 = uuids(device)
    a = live_pids()
    assert device.allocate(a, [g1], 3000)[0]
    device.set_load(a, LIGHT)
    backend = FakeGpuBackend(device.root)
    assert backend.gpus() == device.gpus()
    readings = backend.read(12.0)
    assert [r.sample.gpu for r in readings] == uuids(device)
    assert [r.processes for r in readings] == [(), (GpuProcess(a, 3000),)]
    assert readings[1].sample == replace(device.sample(g1, 12.0), energy_j=0.0)
    assert readings[0].sample.used_mib == 0 and readings[0].sample.t == 12.0
    backend.close()


def test_backend_counts_energy_like_nvml(device: FakeDevice, live_pids: Callable[[], int]) -> None:
    """Joules since the backend started: each interval at the power read at its start, never decreasing."""
    _, g1 = uuids(device)
    backend = FakeGpuBackend(device.root)
    idle = backend.read(100.0)[1].sample
    assert idle.energy_j == 0.0 and idle.power_w > 0
    a = live_pids()
    assert device.allocate(a, [g1], 3000)[0]
    device.set_load(a, BUSY)
    busy = backend.read(110.0)[1].sample
    assert busy.energy_j == pytest.approx(10 * idle.power_w)
    assert busy.power_w > idle.power_w
    later = backend.read(112.0)[1].sample
    assert later.energy_j == pytest.approx(10 * idle.power_w + 2 * busy.power_w)


def test_fake_env_points_jobs_at_the_device(tmp_path: Path) -> None:
    device = FakeDevice.create(tmp_path, [A100], time_scale=60)
    assert fake_env(tmp_path) == {"CARMA_FAKE_GPUS": str(device.root), "CARMA_TIME_SCALE": "60.0"}


def _grab(root: Path, uuid: str, start: Event, hold: Event, results: Queue[bool]) -> None:
    """A worker process: allocate 6 GiB when told to, report, and hold it until told to stop."""
    device = FakeDevice.open(root)
    start.wait()
    results.put(device.allocate(os.getpid(), [uuid], 6144)[0])
    hold.wait()


def test_concurrent_allocations_never_over_commit(tmp_path: Path) -> None:
    device = FakeDevice.create(tmp_path, [A100])
    (g0,) = uuids(device)
    ctx = multiprocessing.get_context("spawn")
    start, hold, results = ctx.Event(), ctx.Event(), ctx.Queue()
    workers = [ctx.Process(target=_grab, args=(device.root, g0, start, hold, results)) for _ in range(8)]
    for w in workers:
        w.start()
    start.set()
    try:
        outcomes = [results.get(timeout=30) for _ in workers]
        assert sum(outcomes) == 6  # 6 x 6 GiB fit in 40 GiB, a 7th does not
        assert used(device, g0) == 6 * 6144
    finally:
        hold.set()
        for w in workers:
            w.join(timeout=30)
    assert device.processes(g0) == []


# ----------------------------------------------------------------- fake jobs as real processes


JobStarter = Callable[..., subprocess.Popen[str]]


@pytest.fixture
def fast(tmp_path: Path) -> FakeDevice:
    return FakeDevice.create(tmp_path / "fast", [A100, A100], time_scale=SCALE)


@pytest.fixture
def start_job(fast: FakeDevice) -> Iterator[JobStarter]:
    """Start `python -m carma.fakejob` on `gpus` of the fast device; whatever still runs is killed afterwards."""
    started: list[subprocess.Popen[str]] = []

    def start(gpus: list[str], *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        job_env = {**os.environ, **fake_env(fast.root), "CUDA_VISIBLE_DEVICES": ",".join(gpus)}
        command = [sys.executable, "-m", "carma.fakejob", "--ttfk", "1", "--warmup", "1", *args]
        env = job_env if env is None else env
        started.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return started[-1]

    yield start
    for job in started:
        job.kill()
        job.communicate()


def test_job_shows_on_its_gpu_while_running_and_exits_0(fast: FakeDevice, start_job: JobStarter) -> None:
    g0, _ = uuids(fast)
    backend = FakeGpuBackend(fast.root)
    job = start_job([g0], "--mem", "4GiB", "--mem-first", "1GiB", "--warmup", "10", "--seconds", "20")
    wait_until(lambda: backend.read(0.0)[0].processes == (GpuProcess(job.pid, 1024),))
    wait_until(lambda: backend.read(0.0)[0].processes == (GpuProcess(job.pid, 4096),))
    wait_until(lambda: backend.read(0.0)[0].sample.smact > 0)
    out, err = job.communicate(timeout=30)
    assert job.returncode == 0, err
    assert "step 10/10" in out
    assert backend.read(0.0)[0].processes == ()


def test_job_counts_its_time_to_first_kernel_from_its_launch(fast: FakeDevice, start_job: JobStarter) -> None:
    """Its own start-up (a Python interpreter, a fraction of a wall second) is part of the time to first kernel
    that carma launched it with: under a time scale, counting it again made first kernels late in the replay."""
    g0, _ = uuids(fast)
    backend = FakeGpuBackend(fast.root)
    launched = {"CARMA_LAUNCHED_AT": f"{time.time() - 3600:.3f}"}  # its hour to first kernel is over
    env = {**os.environ, **fake_env(fast.root), "CUDA_VISIBLE_DEVICES": g0, **launched}
    job = start_job([g0], "--mem", "4GiB", "--ttfk", str(3600 * SCALE), "--warmup", "0", "--seconds", "1e9", env=env)
    wait_until(lambda: backend.read(0.0)[0].processes == (GpuProcess(job.pid, 4096),))


def test_job_that_does_not_fit_exits_1_out_of_memory(fast: FakeDevice, start_job: JobStarter) -> None:
    g0, _ = uuids(fast)
    job = start_job([g0], "--mem", "48GiB", "--seconds", "5")
    _, err = job.communicate(timeout=30)
    assert job.returncode == 1
    assert err.startswith("Traceback (most recent call last):")
    last = err.strip().splitlines()[-1]
    assert last.startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 47.50 GiB. GPU 0")
    assert classify_exit(ProcessExit(1, err)) == ExitKind.OOM
    assert fast.processes(g0) == []


def test_sigterm_releases_memory_and_exits_143(fast: FakeDevice, start_job: JobStarter) -> None:
    g0, g1 = uuids(fast)
    job = start_job([g0, g1], "--mem", "8GiB", "--seconds", "3600")
    wait_until(lambda: used(fast, g1) == 8192)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=30)
    assert job.returncode == 143
    assert "received SIGTERM" in err
    assert list((fast.root / "procs").glob("*.json")) == []


def test_collocated_jobs_slow_each_other_down(fast: FakeDevice, start_job: JobStarter) -> None:
    g0, _ = uuids(fast)
    load = ["--gract", "0.9", "--smact", "0.6", "--smocc", "0.3", "--drama", "0.5"]
    second = start_job([g0], "--mem", "4GiB", "--seconds", "3600", *load)
    first = start_job([g0], "--mem", "4GiB", "--seconds", "20", *load)
    wait_until(lambda: sum(1 for _, _, computing in fast.processes(g0) if computing) == 2)
    slowdown = calibrated_interference().slowdowns([BUSY, BUSY], "mps")[0]
    assert slowdown > 1
    assert fast.speed(first.pid) == pytest.approx(1 / slowdown)
    assert fast.speed(second.pid) == pytest.approx(1 / slowdown)
    second.send_signal(signal.SIGTERM)
    second.wait(timeout=30)
    assert fast.speed(first.pid) == 1.0  # alone again: solo speed
    out, _ = first.communicate(timeout=30)
    assert first.returncode == 0 and "step 10/10" in out


def test_exit_code_option_fails_on_purpose(fast: FakeDevice, start_job: JobStarter) -> None:
    g0, _ = uuids(fast)
    job = start_job([g0], "--mem", "1GiB", "--seconds", "3", "--exit-code", "3")
    _, err = job.communicate(timeout=30)
    assert job.returncode == 3
    assert "--exit-code 3" in err
    assert fast.processes(g0) == []


def test_job_without_cuda_visible_devices_exits_2(fast: FakeDevice, start_job: JobStarter) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | fake_env(fast.root)
    job = start_job([], "--mem", "1GiB", "--seconds", "3", env=env)
    _, err = job.communicate(timeout=30)
    assert job.returncode == 2
    assert err.count("\n") == 1 and "CUDA_VISIBLE_DEVICES" in err


def test_job_on_real_gpu_uuids_exits_2(fast: FakeDevice, start_job: JobStarter) -> None:
    env = {**os.environ, **fake_env(fast.root), "CUDA_VISIBLE_DEVICES": "GPU-5fd2a8b1-0c3e-4b7a-9d11-2f1e6a7c8b90"}
    job = start_job([], "--mem", "1GiB", "--seconds", "3", env=env)
    _, err = job.communicate(timeout=30)
    assert job.returncode == 2 and "names no fake GPUs" in err


def test_a_registration_of_no_size_or_memory_a_gpu_could_hold_is_none(tmp_path):
    """The registry is open to every user under a root daemon: a sparse file of a terabyte stopped the daemon
    (MemoryError reading it whole), and 10^30 MiB showed as used."""
    import os

    from carma.telemetry.fake import _read_registration

    sparse = tmp_path / f"{os.getpid()}.json"
    with open(sparse, "wb") as f:
        f.truncate(1 << 40)
    assert _read_registration(sparse) is None
    sparse.write_text(f'{{"pid": {os.getpid()}, "mib": {{"GPU-x": {10**30}}}, "load": null}}')
    assert _read_registration(sparse) is None
    sparse.write_text(f'{{"pid": {os.getpid()}, "mib": {{"GPU-x": 1024}}, "load": null}}')
    assert _read_registration(sparse).mib == {"GPU-x": 1024}
