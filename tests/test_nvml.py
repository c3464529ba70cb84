"""The NVML backend against a fake NVML module: parsing, GPM, DCGM, MIG (over the MIG-semantics fake that
`NvmlMigControl` changes), and degraded telemetry."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pynvml
import pytest

from carma.core.mig.geometry import Geometry
from carma.core.types import MigSlot, TargetKind
from carma.telemetry.dcgm import DcgmDmon, parse_dmon_line
from carma.telemetry.mig import NvmlMigControl
from carma.telemetry.nvml import NvmlBackend, NvmlUnavailable, load_nvml
from fake_mig_nvml import FakeMigDevice, FakeMigNvml
from support import wait_until

GIB = 1 << 30


def nvml_error(code: int) -> Exception:
    """pynvml's own exception for an NVML return code (e.g. NVMLError_NotSupported), as the library raises it."""
    return pynvml.NVMLError(code)


class FakeNvml:
    """The slice of pynvml the backend uses, with devices described by dicts, raising pynvml's exceptions.
    `raises` maps (function name, device uuid) to what that call raises on that device."""

    NVMLError = pynvml.NVMLError
    NVMLLibraryMismatchError = pynvml.NVMLLibraryMismatchError

    NVML_SUCCESS = 0
    NVML_DEVICE_MIG_ENABLE = 1
    NVML_DEVICE_ARCH_AMPERE = 7
    NVML_DEVICE_ARCH_HOPPER = 9
    NVML_TEMPERATURE_GPU = 0
    NVML_GPM_METRICS_GET_VERSION = 1
    NVML_GPM_METRIC_GRAPHICS_UTIL = 1
    NVML_GPM_METRIC_SM_UTIL = 2
    NVML_GPM_METRIC_SM_OCCUPANCY = 3
    NVML_GPM_METRIC_DRAM_BW_UTIL = 10

    class c_nvmlGpmMetricsGet_t:
        def __init__(self) -> None:
            self.metrics = [SimpleNamespace(metricId=0, nvmlReturn=0, value=0.0) for _ in range(8)]

    def __init__(self, devices, gpm_values=None, names=None) -> None:  # type: ignore[no-untyped-def]
        self.devices = devices
        self.gpm_values = gpm_values or {}  # metric id -> percent
        self.names = names or {}
        self.shut = False
        self.fail = set()
        self.raises: dict[tuple[str, str], Exception] = {}
        self.old_driver = False  # no _v3 process queries: nvidia-ml-py's unversioned ones raise a mismatch

    def _check(self, call: str, h) -> None:  # type: ignore[no-untyped-def]
        if (call, h["uuid"]) in self.raises:
            raise self.raises[call, h["uuid"]]

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        self._check("nvmlDeviceGetHandleByIndex", self.devices[i])
        return self.devices[i]

    def nvmlDeviceGetName(self, h):
        return h["name"].encode()

    def nvmlDeviceGetUUID(self, h):
        return h["uuid"]

    def nvmlDeviceGetMemoryInfo(self, h):
        if h["uuid"] in self.fail:
            raise nvml_error(pynvml.NVML_ERROR_GPU_IS_LOST)
        return SimpleNamespace(total=h["total"], used=h.get("used", 0), free=h["total"] - h.get("used", 0))

    def nvmlDeviceGetMigMode(self, h):
        raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)  # GPUs without MIG: MIG's are FakeMigNvml's

    def nvmlDeviceGetArchitecture(self, h):
        return h.get("arch", self.NVML_DEVICE_ARCH_AMPERE)

    def nvmlGpmQueryDeviceSupport(self, h):
        return SimpleNamespace(isSupportedDevice=1)

    def nvmlGpmSampleAlloc(self):
        return SimpleNamespace(taken=0)

    def nvmlGpmSampleGet(self, h, sample):
        self._check("nvmlGpmSampleGet", h)
        sample.taken += 1
        self.gpm_samples = getattr(self, "gpm_samples", 0) + 1

    def nvmlGpmMetricsGet(self, query):
        assert query.sample1 is not query.sample2 and query.numMetrics == 4
        for m in query.metrics[: query.numMetrics]:
            if m.metricId in self.gpm_values:
                m.value = self.gpm_values[m.metricId]
            else:
                m.nvmlReturn = 3  # not supported

    def nvmlGpmSampleFree(self, sample):
        pass

    def nvmlDeviceGetPowerUsage(self, h):
        self._check("nvmlDeviceGetPowerUsage", h)
        return h.get("power_mw", 100_000)

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        self._check("nvmlDeviceGetTotalEnergyConsumption", h)
        return h.get("energy_mj", 5_000_000)

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 40

    def nvmlDeviceGetComputeRunningProcesses_v2(self, h):
        return [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in h.get("procs", [])]

    def nvmlDeviceGetMPSComputeRunningProcesses_v2(self, h):
        return [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in h.get("mps", [])]

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        if self.old_driver:
            raise self.NVMLLibraryMismatchError("Unversioned function called ...")
        return self.nvmlDeviceGetComputeRunningProcesses_v2(h)

    def nvmlDeviceGetMPSComputeRunningProcesses(self, h):
        if self.old_driver:
            raise self.NVMLLibraryMismatchError("Unversioned function called ...")
        return self.nvmlDeviceGetMPSComputeRunningProcesses_v2(h)

    def nvmlSystemGetProcessName(self, pid):
        if pid not in self.names:
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return self.names[pid]

    def nvmlShutdown(self):
        self.shut = True


def hopper(**extra):  # type: ignore[no-untyped-def]
    return {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-h", "total": 80 * GIB, "arch": 9, **extra}


def ampere(**extra):  # type: ignore[no-untyped-def]
    return {"name": "NVIDIA A100-SXM4-40GB", "uuid": "GPU-a", "total": 40 * GIB, **extra}


def no_dcgm(_gpus, _interval_ms):  # type: ignore[no-untyped-def]
    raise FileNotFoundError("dcgmi not found")


def test_hopper_reads_profiling_metrics_from_gpm():
    nvml = FakeNvml([hopper(used=10 * GIB)], gpm_values={1: 60.0, 2: 45.0, 3: 20.0, 10: 30.0})
    backend = NvmlBackend(nvml, dcgm_factory=no_dcgm)
    (info,) = backend.gpus()
    assert (info.name, info.total_mib, info.id, info.shareable) == ("NVIDIA H100 80GB HBM3", 81920, "GPU-h", True)
    first = backend.read(1.0)[0].sample
    assert (first.smact, first.smocc, first.drama) == (None, None, None)  # GPM needs two samples
    second = backend.read(2.0)[0].sample
    assert (second.gract, second.smact, second.smocc, second.drama) == pytest.approx((0.60, 0.45, 0.20, 0.30))
    assert (second.used_mib, second.power_w, second.energy_j, second.temperature_c) == (10240, 100.0, 5000.0, 40)
    assert backend.missing() == {}
    backend.close()
    assert nvml.shut


def test_a_gpm_metric_the_gpu_cannot_give_is_missing_not_zero():
    backend = NvmlBackend(FakeNvml([hopper()], gpm_values={2: 50.0}), dcgm_factory=no_dcgm)
    backend.read(1.0)
    sample = backend.read(2.0)[0].sample
    assert sample.smact == pytest.approx(0.5) and sample.smocc is None and sample.drama is None


class Dmon:
    """A DCGM stream that answers, until it dies."""

    def __init__(self, gpus, interval_ms):  # type: ignore[no-untyped-def]
        self.gpus, self.interval_ms = list(gpus), interval_ms
        self.running = True

    def alive(self) -> bool:
        return self.running

    def latest(self, gpu):  # type: ignore[no-untyped-def]
        return {"smact": 0.6, "smocc": 0.3, "drama": None} if self.running else None

    def close(self) -> None:
        self.running = False


def test_before_hopper_metrics_come_from_dcgm():
    backend = NvmlBackend(FakeNvml([ampere(), ampere(uuid="GPU-b")]), dcgm_factory=Dmon)
    assert (backend._dcgm.gpus, backend._dcgm.interval_ms) == ([0, 1], 1000)
    sample = backend.read(1.0)[1].sample
    assert (sample.smact, sample.smocc, sample.drama) == (0.6, 0.3, None)
    assert backend.missing() == {}


def test_dcgm_streams_at_the_daemons_sampling_period():
    """It streamed every second whatever `sample_interval_s` said, so a window of samples spanned other times."""
    assert NvmlBackend(FakeNvml([ampere()]), dcgm_factory=Dmon, interval_s=0.25)._dcgm.interval_ms == 250


def test_a_dcgm_stream_that_died_leaves_the_metrics_missing_not_zero():
    """E.g. dcgmi is installed but no host engine runs: dmon exits at once."""
    backend = NvmlBackend(FakeNvml([ampere()]), dcgm_factory=Dmon)
    backend._dcgm.running = False
    assert backend.missing() == {"GPU-a": ("smact", "smocc", "drama")}
    sample = backend.read(1.0)[0].sample
    assert (sample.smact, sample.smocc, sample.drama) == (None, None, None)


def test_without_gpm_or_dcgm_the_metrics_are_reported_missing():
    backend = NvmlBackend(FakeNvml([ampere()]), dcgm_factory=no_dcgm)
    assert backend.missing() == {"GPU-a": ("smact", "smocc", "drama")}
    sample = backend.read(1.0)[0].sample
    assert (sample.smact, sample.smocc, sample.drama) == (None, None, None)


def test_processes_include_mps_clients_and_leave_out_the_mps_server():
    device = ampere(procs=[(100, 2 * GIB), (7, 512 << 20)], mps=[(200, 3 * GIB), (100, 2 * GIB), (300, None)])
    backend = NvmlBackend(FakeNvml([device], names={7: "/usr/bin/nvidia-cuda-mps-server"}), dcgm_factory=no_dcgm)
    processes = backend.read(1.0)[0].processes
    assert sorted((p.pid, p.used_mib) for p in processes) == [(100, 2048), (200, 3072), (300, 0)]


A100 = Geometry.of("A100-40GB")


def mig_a100(uuid: str = "GPU-a", geometry: Geometry = A100, mig_enabled: bool = True) -> FakeMigDevice:
    return FakeMigDevice(uuid, "NVIDIA A100-SXM4-40GB", 40960, geometry, mig_enabled=mig_enabled)


def mig_nvml(*devices: FakeMigDevice) -> tuple[FakeMigNvml, NvmlMigControl]:
    nvml = FakeMigNvml(list(devices))
    return nvml, NvmlMigControl(nvml, is_privileged=lambda: True)


def make(control: NvmlMigControl, gpu: str, profile_id: int, start: int, *compute_slices: int) -> int:
    """A GPU instance and its compute instances (by default one spanning it, as carma makes them)."""
    gi = control.create_gpu_instance(gpu, profile_id, start)
    for slices in compute_slices or (next(p for p in A100.profiles if p.profile_id == profile_id).compute_slices,):
        control.create_compute_instance(gpu, gi, slices)
    return gi


def profile_id(name: str) -> int:
    return A100.profile(name).profile_id


def test_mig_instances_are_exclusive_targets_placed_by_their_slot():
    nvml, control = mig_nvml(mig_a100(), mig_a100("GPU-b", mig_enabled=False))
    make(control, "GPU-a", profile_id("3g.20gb"), 4)
    make(control, "GPU-a", profile_id("2g.10gb"), 0)
    backend = NvmlBackend(nvml, dcgm_factory=no_dcgm)
    targets = [(g.name, g.kind, g.gpu, g.total_mib, g.compute, g.shareable, g.slot) for g in backend.gpus()]
    assert targets == [
        ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", TargetKind.MIG, "GPU-a", 19968, 42, False, MigSlot("3g.20gb", 4)),
        ("NVIDIA A100-SXM4-40GB MIG 2g.10gb", TargetKind.MIG, "GPU-a", 9856, 28, False, MigSlot("2g.10gb", 0)),
        ("NVIDIA A100-SXM4-40GB", TargetKind.GPU, "GPU-b", 40960, 0, True, None),
    ]
    ids = [g.id for g in backend.gpus()]
    assert ids[0].startswith("MIG-") and ids[1].startswith("MIG-") and ids[0] != ids[1]
    readings = backend.read(1.0)
    assert [r.sample.gpu for r in readings] == ids
    assert (readings[0].sample.power_w, readings[0].sample.temperature_c, readings[2].sample.power_w) == (None, 40, 100)
    assert backend.missing() == {"GPU-b": ("smact", "smocc", "drama")}  # instances need none: never shared


def test_refresh_lists_the_layout_a_reconfiguration_left(caplog):
    nvml, control = mig_nvml(mig_a100())
    backend = NvmlBackend(nvml, dcgm_factory=no_dcgm)  # MIG mode on, no instance yet: a GPU to partition, no error
    assert backend.gpus() == []
    assert "GPU-a (NVIDIA A100-SXM4-40GB) has MIG mode on and no MIG instance yet" in caplog.text
    make(control, "GPU-a", profile_id("3g.20gb"), 0)
    replaced = make(control, "GPU-a", profile_id("3g.20gb"), 4)
    backend.refresh()
    before = {g.slot: g.id for g in backend.gpus()}
    assert list(before) == [MigSlot("3g.20gb", 0), MigSlot("3g.20gb", 4)]

    control.destroy_gpu_instance("GPU-a", replaced)
    make(control, "GPU-a", profile_id("2g.10gb"), 4)
    control.create_gpu_instance("GPU-a", profile_id("1g.5gb"), 6)  # no compute instance yet: no MIG device
    assert [g.slot for g in backend.gpus()] == list(before)  # what was discovered, until refreshed
    backend.refresh()
    after = {g.slot: g.id for g in backend.gpus()}
    assert list(after) == [MigSlot("3g.20gb", 0), MigSlot("2g.10gb", 4)]
    assert after[MigSlot("3g.20gb", 0)] == before[MigSlot("3g.20gb", 0)]  # the instance left alone is the same
    assert [r.sample.gpu for r in backend.read(1.0)] == list(after.values())  # read through the new handles


def test_an_instance_without_a_known_slot_stays_a_static_target_with_one_warning(caplog):
    """A profile newer than carma's table, a card it has no geometry of, or a GPU instance split into
    several compute instances (each a MIG device, all on one slot): placed on as found, never reshaped."""
    newer = replace(A100.profile("1g.5gb"), name="1g.5gb+gfx", profile_id=47)
    card = mig_a100(geometry=Geometry("A100-40GB", (*A100.profiles, newer)))
    nvml, control = mig_nvml(card, FakeMigDevice("GPU-x", "NVIDIA A30", 24576, A100))
    make(control, "GPU-a", 47, 0, 1)
    make(control, "GPU-a", profile_id("3g.20gb"), 4, 1, 2)
    make(control, "GPU-x", profile_id("3g.20gb"), 0)
    backend = NvmlBackend(nvml, dcgm_factory=no_dcgm)
    targets = [(g.name, g.kind, g.slot) for g in backend.gpus()]
    assert targets == [
        ("NVIDIA A100-SXM4-40GB MIG 1g.5gb+gfx", TargetKind.MIG, None),
        ("NVIDIA A100-SXM4-40GB MIG 1c.3g.20gb", TargetKind.MIG, None),
        ("NVIDIA A100-SXM4-40GB MIG 2c.3g.20gb", TargetKind.MIG, None),
        ("NVIDIA A30 MIG 3g.20gb", TargetKind.MIG, None),
    ]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 4  # one per instance, and one for the card (not one per instance of it)
    assert "GPU-instance profile 47 is none of the A100-40GB's carma knows" in warnings[0]
    assert "its compute instance has 1 of its GPU instance's 3 slices" in warnings[1]
    assert warnings[3].startswith("GPU-x: its MIG instances get no slot: no MIG geometry for 'NVIDIA A30'")
    backend.refresh()
    assert len(caplog.records) == 4  # not again at each refresh


def test_refresh_keeps_a_whole_gpus_gpm_interval():
    """A new GPM sampler would need a sample to open its interval: the metrics would go missing a round."""
    backend = NvmlBackend(FakeNvml([hopper()], gpm_values={2: 45.0, 3: 20.0, 10: 30.0}), dcgm_factory=no_dcgm)
    backend.read(1.0)
    backend.refresh()
    assert backend.read(2.0)[0].sample.smact == pytest.approx(0.45)


def test_a_gpu_that_fails_to_read_is_skipped_with_a_warning(caplog):
    nvml = FakeNvml([ampere(), ampere(uuid="GPU-b")])
    backend = NvmlBackend(nvml, dcgm_factory=no_dcgm)
    nvml.fail.add("GPU-b")
    readings = backend.read(1.0)
    assert [r.sample.gpu for r in readings] == ["GPU-a"]
    assert "GPU is lost" in caplog.text


def test_a_reading_the_gpu_does_not_give_is_unknown_and_the_gpu_stays(caplog):
    """Power is NotSupported on some vGPUs, energy before Volta, GPM without profiling permission: the GPU
    was dropped from every reading (so never idle, never used), with a warning each second."""
    nvml = FakeNvml([hopper(used=10 * GIB, procs=[(100, 2 * GIB)])], gpm_values={2: 45.0, 3: 20.0, 10: 30.0})
    for call, code in [
        ("nvmlDeviceGetPowerUsage", pynvml.NVML_ERROR_NOT_SUPPORTED),
        ("nvmlDeviceGetTotalEnergyConsumption", pynvml.NVML_ERROR_NOT_SUPPORTED),
        ("nvmlGpmSampleGet", pynvml.NVML_ERROR_NO_PERMISSION),
    ]:
        nvml.raises[call, "GPU-h"] = nvml_error(code)
    backend = NvmlBackend(nvml, dcgm_factory=no_dcgm)
    for t in (1.0, 2.0, 3.0):
        (reading,) = backend.read(t)
    sample = reading.sample
    assert (sample.used_mib, sample.temperature_c, [p.pid for p in reading.processes]) == (10240, 40, [100])
    assert (sample.power_w, sample.energy_j, sample.smact, sample.smocc, sample.drama) == (None,) * 5
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3  # one per reading, not one per second
    assert "NVIDIA H100 80GB HBM3 gives no power (Not Supported): it is left unknown" in warnings


def test_gpm_is_sampled_no_faster_than_nvml_refreshes_it():
    nvml = FakeNvml([hopper()], gpm_values={2: 45.0, 3: 20.0, 10: 30.0})
    backend = NvmlBackend(nvml, dcgm_factory=no_dcgm)
    backend.read(1.0)
    second = backend.read(2.0)[0].sample
    assert backend.read(2.05)[0].sample.smact == second.smact == pytest.approx(0.45)  # the last metrics again
    assert nvml.gpm_samples == 2


def test_an_old_driver_without_v3_process_queries_still_reports_processes():
    """nvidia-ml-py's unversioned queries call _v3 and raise NVMLLibraryMismatchError, which is no
    NVMLError, on a driver without it: it escaped the reading and stopped the scheduling loop."""
    nvml = FakeNvml([ampere(procs=[(100, 2 * GIB)], mps=[(200, GIB)])])
    nvml.old_driver = True
    backend = NvmlBackend(nvml, dcgm_factory=no_dcgm)
    for t in (1.0, 2.0):
        processes = backend.read(t)[0].processes
    assert sorted((p.pid, p.used_mib) for p in processes) == [(100, 2048), (200, 1024)]


def test_a_gpu_nvml_counts_but_cannot_open_is_left_out_with_a_warning(caplog):
    """NVML counts every GPU, even one a cgroup's device list keeps this process from (NoPermission)."""
    nvml = FakeNvml([ampere(), ampere(uuid="GPU-b")])
    nvml.raises["nvmlDeviceGetHandleByIndex", "GPU-b"] = nvml_error(pynvml.NVML_ERROR_NO_PERMISSION)
    backend = NvmlBackend(nvml, dcgm_factory=no_dcgm)
    assert [g.id for g in backend.gpus()] == ["GPU-a"]
    assert "GPU 1 left out: NVML cannot read it (Insufficient Permissions)" in caplog.text
    nvml.raises["nvmlDeviceGetHandleByIndex", "GPU-a"] = nvml_error(pynvml.NVML_ERROR_NO_PERMISSION)
    with pytest.raises(NvmlUnavailable, match=r"sees no GPU it can read"):
        NvmlBackend(nvml, dcgm_factory=no_dcgm)


def test_an_nvml_without_gpm_or_a_gpu_count_is_no_traceback(caplog, monkeypatch):
    """An old `pynvml` package shadowing nvidia-ml-py has no GPM functions; a failing count was an
    NVMLError out of `carma server`, which is no NvmlUnavailable and so printed a traceback."""
    nvml = FakeNvml([hopper()])
    monkeypatch.delattr(FakeNvml, "nvmlGpmQueryDeviceSupport")
    assert NvmlBackend(nvml, dcgm_factory=no_dcgm).missing() == {"GPU-h": ("smact", "smocc", "drama")}
    assert "`pip uninstall pynvml`" in caplog.text

    def count(self):  # type: ignore[no-untyped-def]
        raise nvml_error(pynvml.NVML_ERROR_UNKNOWN)

    monkeypatch.setattr(FakeNvml, "nvmlDeviceGetCount", count)
    with pytest.raises(NvmlUnavailable, match=r"^NVML cannot count the GPUs \(Unknown Error\)$"):
        NvmlBackend(nvml, dcgm_factory=no_dcgm)


def test_no_gpu_at_all_is_a_clear_error():
    with pytest.raises(NvmlUnavailable, match="sees no GPU"):
        NvmlBackend(FakeNvml([]), dcgm_factory=no_dcgm)


def test_missing_library_and_driver_are_clear_errors(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    with pytest.raises(NvmlUnavailable, match="pip install nvidia-ml-py"):
        load_nvml()

    class Broken:
        class NVMLError(Exception):
            pass

        def nvmlInit(self):
            raise self.NVMLError("Driver Not Loaded")

    monkeypatch.setitem(sys.modules, "pynvml", Broken())
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        load_nvml()


DCGMI = str(Path(__file__).parent / "bin" / "dcgmi")  # a stand-in for `dcgmi dmon`


def test_dcgm_dmon_streams_the_latest_values_per_gpu():
    dmon = DcgmDmon([0, 2], interval_ms=50, binary=DCGMI)
    wait_until(lambda: dmon.latest(2) is not None, 10, "dmon's first values")
    assert dmon.latest(2) == {"gract": 0.8, "smact": 0.5, "smocc": 0.25, "drama": None} and dmon.latest(1) is None
    dmon.close()
    assert not dmon.alive()


def test_dcgm_without_a_host_engine_is_reported_missing_saying_why(monkeypatch, caplog):
    """dmon ends at once then; decided right after its start, it was still alive: no warning of missing
    metrics at the server's start, and its error message thrown away."""
    monkeypatch.setenv("FAKE_DCGM_NO_ENGINE", "1")
    with pytest.raises(OSError, match=r"^dcgmi dmon stopped at once: Error: unable to establish a connection"):
        DcgmDmon([0], binary=DCGMI)
    backend = NvmlBackend(FakeNvml([ampere()]), dcgm_factory=lambda gpus, ms: DcgmDmon(gpus, ms, binary=DCGMI))
    assert backend.missing() == {"GPU-a": ("smact", "smocc", "drama")}
    assert "Unable to connect to host engine" in caplog.text


@pytest.mark.parametrize(
    ("line", "parsed"),
    [
        ("#Entity   GRACT  SMACT  SMOCC  DRAMA", None),
        ("ID", None),
        ("GPU 0     0.9  0.512  0.201  0.100", (0, {"gract": 0.9, "smact": 0.512, "smocc": 0.201, "drama": 0.1})),
        ("GPU 3     N/A  N/A    0.201  N/A", (3, {"gract": None, "smact": None, "smocc": 0.201, "drama": None})),
        ("GPU 3     0.512  0.201  0.100", None),  # a field short
        ("GPU x 1 2 3 4", None),
    ],
)
def test_dcgm_dmon_lines(line, parsed):
    assert parse_dmon_line(line) == parsed
