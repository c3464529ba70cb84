"""Real GPUs through NVML (nvidia-ml-py): memory, power, energy, temperature, processes, and the
profiling metrics SMACT, SMOCC and DRAMA (the risk rule's) and GRACT (the interference model's).

One NVML session for the daemon's lifetime, no subprocess per sample. The profiling metrics come from
NVML's GPU Performance Monitoring (GPM: Hopper and newer) or from DCGM (`dcgmi dmon`, e.g. on an A100);
where neither exists they are reported missing (None), and the risk rule's `missing` setting decides,
never a made-up zero. MIG instances are discovered (carma.telemetry.mig creates and destroys them) and become
exclusive placement targets, each with its slot (profile and first memory slice) where carma's MIG geometry
knows the card and the profile; `refresh` discovers them again after a reconfiguration.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from carma.core.mig.geometry import Geometry, UnknownModel
from carma.core.types import GpuSample, MigSlot, Target, TargetKind
from carma.telemetry import DeviceReading, GpuProcess

METRICS = ("smact", "smocc", "drama")
GPM_METRICS = {
    "gract": "NVML_GPM_METRIC_GRAPHICS_UTIL",
    "smact": "NVML_GPM_METRIC_SM_UTIL",
    "smocc": "NVML_GPM_METRIC_SM_OCCUPANCY",
    "drama": "NVML_GPM_METRIC_DRAM_BW_UTIL",
}
MPS_SERVER = "nvidia-cuda-mps"  # the MPS server's process name starts so: infrastructure, not a foreign job
GPM_MIN_INTERVAL_S = 0.1  # NVML refreshes GPM samples no faster: two taken closer give no valid metrics
MIB = 1 << 20
log = logging.getLogger("carma.nvml")
T = TypeVar("T")


class NvmlUnavailable(RuntimeError):
    """No usable NVML: library, driver or GPU missing; the message says which."""


class _NoSlot(Exception):
    """Why a MIG instance gets no slot."""


def load_nvml() -> Any:
    try:
        import pynvml
    except ImportError:
        raise NvmlUnavailable("real GPUs need nvidia-ml-py (a dependency of carma): pip install nvidia-ml-py") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise NvmlUnavailable(
            f"NVML could not start ({e}): is the NVIDIA driver installed and a GPU present?"
        ) from None
    return pynvml


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class _Gpm:
    """GPM metrics of one GPU over the time between two of its samples (the previous read and this one)."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml = nvml
        self._handle = handle
        self._samples = [nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()]
        self._primed = False
        self._sampled_at = -float("inf")
        self._last: dict[str, float | None] | None = None

    def read(self, now: float) -> dict[str, float | None] | None:
        """The metrics since the previous sample (real GPUs: `now` in wall seconds), None for the first."""
        nvml = self._nvml
        if now - self._sampled_at < GPM_MIN_INTERVAL_S:  # read again too soon (a short sample interval)
            return self._last
        self._sampled_at = now
        nvml.nvmlGpmSampleGet(self._handle, self._samples[1])
        if not self._primed:  # the first sample only opens the interval
            self._samples.reverse()
            self._primed = True
            return None
        query = nvml.c_nvmlGpmMetricsGet_t()
        query.version = nvml.NVML_GPM_METRICS_GET_VERSION
        query.numMetrics = len(GPM_METRICS)
        query.sample1, query.sample2 = self._samples
        for k, constant in enumerate(GPM_METRICS.values()):
            query.metrics[k].metricId = getattr(nvml, constant)
        nvml.nvmlGpmMetricsGet(query)
        self._samples.reverse()  # this sample opens the next interval
        self._last = {
            name: query.metrics[k].value / 100 if query.metrics[k].nvmlReturn == nvml.NVML_SUCCESS else None
            for k, name in enumerate(GPM_METRICS)
        }
        return self._last

    def close(self) -> None:
        for sample in self._samples:
            self._nvml.nvmlGpmSampleFree(sample)


@dataclass
class _Target:
    """A placement target: a whole GPU, or a MIG instance of one (`physical` is the GPU's NVML index)."""

    info: Target
    handle: Any
    physical: int
    gpu_handle: Any  # the whole GPU (power, energy and temperature are per GPU, not per instance)
    gpm: _Gpm | None = None


class NvmlBackend:
    """The daemon's GpuBackend for real GPUs."""

    def __init__(
        self,
        nvml: Any | None = None,
        dcgm_factory: Callable[[Iterable[int], int], Any] | None = None,
        interval_s: float = 1.0,
    ) -> None:
        """`interval_s`: the daemon's sampling period, which DCGM streams at, so that a monitor window of
        `window_samples` covers the time the configuration says."""
        self._nvml = nvml if nvml is not None else load_nvml()
        self._failing: set[tuple[str, str]] = set()  # (target, what) whose warning is logged already
        self._targets, readable = self._discover({})
        if not readable:
            raise NvmlUnavailable("NVML sees no GPU it can read on this machine")
        self._dcgm = self._start_dcgm(dcgm_factory, round(interval_s * 1000))
        self._queries = {  # per process list, the function this driver has (see `_processes`)
            name: getattr(self._nvml, name)
            for name in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses")
        }

    # ----------------------------------------------------------------- discovery

    def refresh(self) -> None:
        """Discover the targets again, after a MIG reconfiguration: `gpus` then lists the new layout. A whole
        GPU seen before keeps its GPM sampler (a new one would need a sample to open its interval), and DCGM
        keeps streaming the GPUs it started for; MIG instances have neither."""
        known = {t.info.id: t for t in self._targets}
        self._targets, _ = self._discover(known)
        listed = {t.info.id for t in self._targets}
        for gone in known.values():
            if gone.gpm is not None and gone.info.id not in listed:
                gone.gpm.close()

    def _discover(self, known: Mapping[str, _Target]) -> tuple[list[_Target], int]:
        """The targets, and how many GPUs NVML could read (a MIG GPU without instances is one, with none)."""
        nvml = self._nvml
        targets: list[_Target] = []
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as e:
            raise NvmlUnavailable(f"NVML cannot count the GPUs ({e})") from None
        readable = 0
        for physical in range(count):
            try:  # NVML counts GPUs it may not open (NoPermission under a cgroup's device list, GpuIsLost)
                targets += self._targets_of(physical, known)
                readable += 1
            except nvml.NVMLError as e:
                log.warning("GPU %d left out: NVML cannot read it (%s)", physical, e)
        return targets, readable

    def _targets_of(self, physical: int, known: Mapping[str, _Target]) -> list[_Target]:
        """The GPU of this NVML index as a placement target, or its MIG instances."""
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(physical)
        gpu = self._info(handle)
        if not self._mig_enabled(handle):
            gpm = known[gpu.id].gpm if gpu.id in known else self._gpm(handle)
            return [_Target(gpu, handle, physical, handle, gpm)]
        geometry = self._geometry(gpu)
        found: list[_Target] = []
        for index in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:  # a MIG device is a compute instance: a GPU instance without one has none yet
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
            except nvml.NVMLError_NotFound:
                continue  # an empty index
            found.append(_Target(self._instance(mig, gpu, handle, geometry), mig, physical, handle))
        if not found:
            self._warn_once((gpu.id, "instances"), "%s (%s) has MIG mode on and no MIG instance yet", gpu.id, gpu.name)
        return found

    def _info(self, handle: Any) -> Target:
        """The target of a whole GPU's handle."""
        nvml = self._nvml
        total = nvml.nvmlDeviceGetMemoryInfo(handle).total // MIB
        return Target(_text(nvml.nvmlDeviceGetUUID(handle)), _text(nvml.nvmlDeviceGetName(handle)), total)

    def _instance(self, mig: Any, gpu: Target, gpu_handle: Any, geometry: Geometry | None) -> Target:
        """The target of a MIG device handle. NVML names it with its profile ("NVIDIA A100-SXM4-40GB MIG
        3g.20gb"); `compute` is its SMs."""
        nvml = self._nvml
        info = self._info(mig)
        try:  # NVML gives a device's attributes for MIG device handles only
            attributes = nvml.nvmlDeviceGetAttributes(mig)
        except nvml.NVMLError:
            attributes = None
        slot = self._slot(mig, info, gpu_handle, geometry, attributes)
        sms = attributes.multiprocessorCount if attributes is not None else 0
        return Target(
            info.id, info.name, info.total_mib, TargetKind.MIG, parent=gpu.id, compute=sms, shareable=False, slot=slot
        )

    def _geometry(self, gpu: Target) -> Geometry | None:
        """carma's MIG geometry of the card; None (its instances then static targets) for a card it lacks."""
        try:
            return Geometry.for_product(gpu.name, gpu.total_mib)
        except UnknownModel as e:
            self._warn_once((gpu.id, "geometry"), "%s: its MIG instances get no slot: %s", gpu.id, e)
            return None

    def _slot(
        self, mig: Any, info: Target, gpu_handle: Any, geometry: Geometry | None, attributes: Any | None
    ) -> MigSlot | None:
        """The profile and first memory slice of the MIG device's GPU instance, by which MIG placement finds
        it; None (a static target, with one warning) where they cannot be known."""
        if geometry is None:
            return None
        try:
            return self._read_slot(mig, gpu_handle, geometry, attributes)
        except (self._nvml.NVMLError, _NoSlot) as e:
            self._warn_once((info.id, "slot"), "%s (%s) gets no slot, so no MIG placement: %s", info.name, info.id, e)
            return None

    def _read_slot(self, mig: Any, gpu_handle: Any, geometry: Geometry, attributes: Any | None) -> MigSlot:
        nvml = self._nvml
        gi = nvml.nvmlGpuInstanceGetInfo(
            nvml.nvmlDeviceGetGpuInstanceById(gpu_handle, nvml.nvmlDeviceGetGpuInstanceId(mig))
        )
        profile = next((p for p in geometry.profiles if p.profile_id == gi.profileId), None)
        if profile is None:
            raise _NoSlot(f"GPU-instance profile {gi.profileId} is none of the {geometry.model}'s carma knows")
        # carma makes one compute instance spanning each GPU instance; of two in one, each a MIG device, both
        # would claim the GPU instance's slot
        if attributes is not None and attributes.computeInstanceSliceCount < attributes.gpuInstanceSliceCount:
            raise _NoSlot(
                f"its compute instance has {attributes.computeInstanceSliceCount} of its GPU instance's "
                f"{attributes.gpuInstanceSliceCount} slices"
            )
        return MigSlot(profile.name, gi.placement.start)

    def _mig_enabled(self, handle: Any) -> bool:
        nvml = self._nvml
        try:
            current, _ = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError:
            return False  # a GPU without MIG support
        return current == nvml.NVML_DEVICE_MIG_ENABLE

    def _gpm(self, handle: Any) -> _Gpm | None:
        nvml = self._nvml
        try:
            if nvml.nvmlDeviceGetArchitecture(handle) < nvml.NVML_DEVICE_ARCH_HOPPER:
                return None
            if not nvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice:
                return None
            return _Gpm(nvml, handle)
        except nvml.NVMLError as e:
            log.info("GPM unavailable: %s", e)
            return None
        except AttributeError as e:  # an old `pynvml` package shadowing nvidia-ml-py's module of that name
            log.warning("GPM unavailable: this pynvml lacks it (%s); `pip uninstall pynvml` leaves nvidia-ml-py's", e)
            return None

    def _start_dcgm(self, factory: Callable[[Iterable[int], int], Any] | None, interval_ms: int) -> Any:
        """DCGM for the whole GPUs GPM does not cover; None when there are none or DCGM is absent."""
        needy = sorted({t.physical for t in self._targets if t.gpm is None and t.info.shareable})
        if not needy:
            return None
        if factory is None:
            from carma.telemetry.dcgm import DcgmDmon as factory
        try:
            return factory(needy, interval_ms)
        except FileNotFoundError as e:  # not installed: the start's warning on missing metrics says enough
            log.info("DCGM unavailable: %s", e)
        except OSError as e:  # installed, but it could not stream (e.g. no host engine runs): say why
            log.warning("DCGM unavailable: %s", e)
        return None

    # ----------------------------------------------------------------- the GpuBackend protocol

    def gpus(self) -> list[Target]:
        return [t.info for t in self._targets]

    def missing(self) -> dict[str, tuple[str, ...]]:
        """Per shared GPU, the profiling metrics with no source (MIG instances need none: never shared)."""
        dcgm = self._dcgm is not None and self._dcgm.alive()
        return {t.info.id: METRICS for t in self._targets if t.info.shareable and t.gpm is None and not dcgm}

    def read(self, now: float) -> list[DeviceReading]:
        readings = []
        for target in self._targets:
            try:
                readings.append(self._read(target, now))
            except self._nvml.NVMLError as e:  # e.g. a GPU fallen off the bus: skip it this round, loudly
                log.warning("reading %s failed: %s", target.info.name, e)
        return readings

    def _read(self, target: _Target, now: float) -> DeviceReading:
        """Memory and processes, or no reading; power, energy, temperature and the profiling metrics when the
        GPU gives them (a vGPU may not give power, a GPU before Volta no energy), None otherwise."""
        nvml = self._nvml
        memory = nvml.nvmlDeviceGetMemoryInfo(target.handle)
        metrics = self._metrics(target, now)
        whole = target.info.kind is TargetKind.GPU
        gpu = target.gpu_handle
        sample = GpuSample(
            gpu=target.info.id,
            t=now,
            used_mib=memory.used // MIB,
            total_mib=memory.total // MIB,
            smact=metrics.get("smact"),
            smocc=metrics.get("smocc"),
            drama=metrics.get("drama"),
            gract=metrics.get("gract"),
            power_w=self._optional(target, "power", lambda: nvml.nvmlDeviceGetPowerUsage(gpu) / 1000)
            if whole
            else None,
            energy_j=(
                self._optional(target, "energy", lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(gpu) / 1000)
                if whole
                else None
            ),
            temperature_c=self._optional(
                target, "temperature", lambda: nvml.nvmlDeviceGetTemperature(gpu, nvml.NVML_TEMPERATURE_GPU)
            ),
        )
        return DeviceReading(sample, self._processes(target.handle))

    def _optional(self, target: _Target, reading: str, read: Callable[[], T]) -> T | None:
        """A reading the GPU may not give: None, and a warning the first time it fails (not every second)."""
        try:
            return read()
        except self._nvml.NVMLError as e:
            self._warn_once(
                (target.info.id, reading), "%s gives no %s (%s): it is left unknown", target.info.name, reading, e
            )
            return None

    def _warn_once(self, key: tuple[str, str], message: str, *args: object) -> None:
        """A warning the first time only: readings repeat every second, discovery at every refresh."""
        if key not in self._failing:
            self._failing.add(key)
            log.warning(message, *args)

    def _metrics(self, target: _Target, now: float) -> dict[str, float | None]:
        if (gpm := target.gpm) is not None:
            return self._optional(target, "GPM metrics (SMACT/SMOCC/DRAMA)", lambda: gpm.read(now)) or {}
        if self._dcgm is not None and target.info.shareable:
            return self._dcgm.latest(target.physical) or {}
        return {}

    def _processes(self, handle: Any) -> tuple[GpuProcess, ...]:
        """Compute processes and MPS clients on the target, without the MPS server itself."""
        nvml = self._nvml
        found: dict[int, int] = {}
        for name in self._queries:
            try:
                processes = self._query(name, handle)
            except nvml.NVMLError:
                continue  # e.g. MPS queries on a driver without them
            for p in processes:
                used = (p.usedGpuMemory or 0) // MIB  # None where the driver cannot attribute memory
                found[p.pid] = max(found.get(p.pid, 0), used)
        return tuple(GpuProcess(pid, used) for pid, used in found.items() if not self._is_mps_server(pid))

    def _query(self, name: str, handle: Any) -> Any:
        """A process list; on a driver older than nvidia-ml-py's default (_v3) query, its _v2 from then on."""
        try:
            return self._queries[name](handle)
        except self._nvml.NVMLLibraryMismatchError:  # not an NVMLError: it would stop the scheduling loop
            self._queries[name] = getattr(self._nvml, f"{name}_v2")
            return self._queries[name](handle)

    def _is_mps_server(self, pid: int) -> bool:
        try:
            return _text(self._nvml.nvmlSystemGetProcessName(pid)).rsplit("/", 1)[-1].startswith(MPS_SERVER)
        except self._nvml.NVMLError:
            return False

    def close(self) -> None:
        for target in self._targets:
            if target.gpm is not None:
                target.gpm.close()
        if self._dcgm is not None:
            self._dcgm.close()
        self._nvml.nvmlShutdown()
