"""The NVML backend against a fake NVML module: parsing, GPM, DCGM, MIG, and degraded telemetry."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from carma.telemetry.dcgm import parse_dmon_line
from carma.telemetry.nvml import NvmlBackend, NvmlUnavailable, load_nvml

GIB = 1 << 30


class FakeNvml:
    """The slice of pynvml the backend uses, with devices described by dicts."""

    class NVMLError(Exception):
        pass

    NVML_SUCCESS = 0
    NVML_DEVICE_MIG_ENABLE = 1
    NVML_DEVICE_ARCH_AMPERE = 7
    NVML_DEVICE_ARCH_HOPPER = 9
    NVML_TEMPERATURE_GPU = 0
    NVML_GPM_METRICS_GET_VERSION = 1
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

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.devices[i]

    def nvmlDeviceGetName(self, h):
        return h["name"].encode()

    def nvmlDeviceGetUUID(self, h):
        return h["uuid"]

    def nvmlDeviceGetMemoryInfo(self, h):
        if h["uuid"] in self.fail:
            raise self.NVMLError("GPU is lost")
        return SimpleNamespace(total=h["total"], used=h.get("used", 0), free=h["total"] - h.get("used", 0))

    def nvmlDeviceGetMigMode(self, h):
        if "mig" not in h:
            raise self.NVMLError("Not Supported")
        return (1 if h["mig"] is not None else 0, 0)

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, i):
        if i >= len(h["mig"]):
            raise self.NVMLError("Not Found")
        return h["mig"][i]

    def nvmlDeviceGetArchitecture(self, h):
        return h.get("arch", self.NVML_DEVICE_ARCH_AMPERE)

    def nvmlGpmQueryDeviceSupport(self, h):
        return SimpleNamespace(isSupportedDevice=1)

    def nvmlGpmSampleAlloc(self):
        return SimpleNamespace(taken=0)

    def nvmlGpmSampleGet(self, h, sample):
        sample.taken += 1

    def nvmlGpmMetricsGet(self, query):
        assert query.sample1 is not query.sample2 and query.numMetrics == 3
        for m in query.metrics[: query.numMetrics]:
            if m.metricId in self.gpm_values:
                m.value = self.gpm_values[m.metricId]
            else:
                m.nvmlReturn = 3  # not supported

    def nvmlGpmSampleFree(self, sample):
        pass

    def nvmlDeviceGetPowerUsage(self, h):
        return h.get("power_mw", 100_000)

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        return h.get("energy_mj", 5_000_000)

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 40

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in h.get("procs", [])]

    def nvmlDeviceGetMPSComputeRunningProcesses(self, h):
        return [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in h.get("mps", [])]

    def nvmlSystemGetProcessName(self, pid):
        if pid not in self.names:
            raise self.NVMLError("Not Found")
        return self.names[pid]

    def nvmlShutdown(self):
        self.shut = True


def hopper(**extra):  # type: ignore[no-untyped-def]
    return {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-h", "total": 80 * GIB, "arch": 9, **extra}


def ampere(**extra):  # type: ignore[no-untyped-def]
    return {"name": "NVIDIA A100-SXM4-40GB", "uuid": "GPU-a", "total": 40 * GIB, **extra}


def no_dcgm(_):  # type: ignore[no-untyped-def]
    raise FileNotFoundError("dcgmi not found")


def test_hopper_reads_profiling_metrics_from_gpm():
    nvml = FakeNvml([hopper(used=10 * GIB)], gpm_values={2: 45.0, 3: 20.0, 10: 30.0})
    backend = NvmlBackend(nvml, dcgm_factory=no_dcgm)
    (info,) = backend.gpus()
    assert (info.name, info.total_mib, info.uuid, info.exclusive) == ("NVIDIA H100 80GB HBM3", 81920, "GPU-h", False)
    first = backend.read(1.0)[0].sample
    assert (first.smact, first.smocc, first.drama) == (None, None, None)  # GPM needs two samples
    second = backend.read(2.0)[0].sample
    assert (second.smact, second.smocc, second.drama) == pytest.approx((0.45, 0.20, 0.30))
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

    def __init__(self, gpus):  # type: ignore[no-untyped-def]
        self.gpus = list(gpus)
        self.running = True

    def alive(self) -> bool:
        return self.running

    def latest(self, gpu):  # type: ignore[no-untyped-def]
        return {"smact": 0.6, "smocc": 0.3, "drama": None} if self.running else None

    def close(self) -> None:
        self.running = False


def test_before_hopper_metrics_come_from_dcgm():
    backend = NvmlBackend(FakeNvml([ampere(), ampere(uuid="GPU-b")]), dcgm_factory=Dmon)
    assert backend._dcgm.gpus == [0, 1]
    sample = backend.read(1.0)[1].sample
    assert (sample.smact, sample.smocc, sample.drama) == (0.6, 0.3, None)
    assert backend.missing() == {}


def test_a_dcgm_stream_that_died_leaves_the_metrics_missing_not_zero():
    """E.g. dcgmi is installed but no host engine runs: dmon exits at once."""
    backend = NvmlBackend(FakeNvml([ampere()]), dcgm_factory=Dmon)
    backend._dcgm.running = False
    assert backend.missing() == {0: ("smact", "smocc", "drama")}
    sample = backend.read(1.0)[0].sample
    assert (sample.smact, sample.smocc, sample.drama) == (None, None, None)


def test_without_gpm_or_dcgm_the_metrics_are_reported_missing():
    backend = NvmlBackend(FakeNvml([ampere()]), dcgm_factory=no_dcgm)
    assert backend.missing() == {0: ("smact", "smocc", "drama")}
    sample = backend.read(1.0)[0].sample
    assert (sample.smact, sample.smocc, sample.drama) == (None, None, None)


def test_processes_include_mps_clients_and_leave_out_the_mps_server():
    device = ampere(procs=[(100, 2 * GIB), (7, 512 << 20)], mps=[(200, 3 * GIB), (100, 2 * GIB), (300, None)])
    backend = NvmlBackend(FakeNvml([device], names={7: "/usr/bin/nvidia-cuda-mps-server"}), dcgm_factory=no_dcgm)
    processes = backend.read(1.0)[0].processes
    assert sorted((p.pid, p.used_mib) for p in processes) == [(100, 2048), (200, 3072), (300, 0)]


def test_mig_instances_are_exclusive_targets():
    instances = [
        {"name": "NVIDIA A100-SXM4-40GB MIG 3g.20gb", "uuid": "MIG-1", "total": 20096 << 20, "used": 1 << 30},
        {"name": "NVIDIA A100-SXM4-40GB MIG 2g.10gb", "uuid": "MIG-2", "total": 9856 << 20},
    ]
    nvml = FakeNvml([ampere(mig=instances), ampere(uuid="GPU-b", mig=None)])
    backend = NvmlBackend(nvml, dcgm_factory=no_dcgm)
    targets = [(g.index, g.uuid, g.total_mib, g.exclusive) for g in backend.gpus()]
    assert targets == [(0, "MIG-1", 20096, True), (1, "MIG-2", 9856, True), (2, "GPU-b", 40960, False)]
    readings = backend.read(1.0)
    assert readings[0].sample.used_mib == 1024 and readings[0].sample.power_w is None
    assert backend.missing() == {2: ("smact", "smocc", "drama")}  # instances need no metrics: never shared


def test_a_gpu_that_fails_to_read_is_skipped_with_a_warning(caplog):
    nvml = FakeNvml([ampere(), ampere(uuid="GPU-b")])
    backend = NvmlBackend(nvml, dcgm_factory=no_dcgm)
    nvml.fail.add("GPU-b")
    readings = backend.read(1.0)
    assert [r.sample.gpu for r in readings] == [0]
    assert "GPU is lost" in caplog.text


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


@pytest.mark.parametrize(
    ("line", "parsed"),
    [
        ("#Entity   SMACT  SMOCC  DRAMA", None),
        ("ID", None),
        ("GPU 0     0.512  0.201  0.100", (0, {"smact": 0.512, "smocc": 0.201, "drama": 0.1})),
        ("GPU 3     N/A    0.201  N/A", (3, {"smact": None, "smocc": 0.201, "drama": None})),
        ("GPU x 1 2 3", None),
    ],
)
def test_dcgm_dmon_lines(line, parsed):
    assert parse_dmon_line(line) == parsed
