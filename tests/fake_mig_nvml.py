"""A fake NVML with MIG semantics, for driving `NvmlMigControl` without a GPU.

It answers the MIG calls as NVML does, with nvidia-ml-py's own exception classes and ctypes structures:
a placement the profile does not allow is NVML_ERROR_INVALID_ARGUMENT, one overlapping a taken memory
slice (or past the profile's instance count) NVML_ERROR_INSUFFICIENT_RESOURCES, destroying a compute
instance a process runs on, or a GPU instance that still has compute instances, NVML_ERROR_IN_USE, any
change by an unprivileged caller NVML_ERROR_NO_PERMISSION, and any MIG call on a GPU whose MIG mode is
disabled NVML_ERROR_NOT_SUPPORTED. Instance handles are ctypes pointers, as the real list calls fill in.

It also lists MIG devices as NVML does, for `NvmlBackend`: one per compute instance (a GPU instance without one
has none), at indices below `nvmlDeviceGetMaxMigDeviceCount`, an empty index NVML_ERROR_NOT_FOUND; a MIG
device is named after its profile ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", "... MIG 1c.3g.20gb" for a compute
instance of part of its GPU instance), has its own UUID and its GPU instance's memory, and its handle goes
stale (NVML_ERROR_INVALID_ARGUMENT) once its compute instance is destroyed.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any
from uuid import uuid4

import pynvml

from carma.core.mig.geometry import Geometry


def nvml_error(code: int) -> Exception:
    return pynvml.NVMLError(code)


def _deref(ref: Any) -> Any:
    """What a `ctypes.byref` points at."""
    return ref._obj


def _address(handle: Any) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value


@dataclass(eq=False)  # instances are told apart by identity: two can hold equal fields
class FakeCompute:
    id: int
    profile_id: int
    slices: int
    processes: int = 0
    uuid: str = field(default_factory=lambda: f"MIG-{uuid4()}")  # its MIG device's, new with each instance


@dataclass(eq=False)
class FakeGpuInstance:
    id: int
    profile: Any  # the geometry's profile
    start: int
    computes: list[FakeCompute] = field(default_factory=list)


@dataclass
class FakeMigDevice:
    uuid: str
    product: str
    total_mib: int
    geometry: Geometry
    mig_enabled: bool = True
    has_mig: bool = True
    instances: list[FakeGpuInstance] = field(default_factory=list)

    def held(self) -> int:
        out = 0
        for gi in self.instances:
            out |= ((1 << gi.profile.memory_slices) - 1) << gi.start
        return out

    def mig_devices(self) -> list[tuple[FakeGpuInstance, FakeCompute]]:
        """Its MIG devices in index order: the compute instances, by GPU instance then compute instance id."""
        return [
            (gi, ci)
            for gi in sorted(self.instances, key=lambda g: g.id)
            for ci in sorted(gi.computes, key=lambda c: c.id)
        ]


@dataclass(eq=False)
class FakeMigHandle:
    """A MIG device handle: one compute instance, usable in place of a GPU's handle for per-instance queries."""

    device: FakeMigDevice
    gi: FakeGpuInstance
    ci: FakeCompute


class FakeMigNvml:
    """The slice of pynvml `NvmlMigControl` and `NvmlBackend` use. `privileged=False` makes every change
    NO_PERMISSION."""

    NVMLError = pynvml.NVMLError

    def __init__(self, devices: list[FakeMigDevice], privileged: bool = True) -> None:
        self.devices = devices
        self.privileged = privileged
        self._handles: dict[int, Any] = {}  # address -> FakeGpuInstance or FakeCompute
        self._next_address = 0x1000
        self.mode_changes = 0

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("NVML_", "c_nvml", "NVMLError_")):  # constants, structures, exception classes
            return getattr(pynvml, name)
        raise AttributeError(f"the fake NVML has no {name}")

    # ------------------------------------------------------------ devices

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeMigDevice:
        return self.devices[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeMigDevice:
        for d in self.devices:
            if d.uuid == uuid:
                return d
        raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetUUID(self, d: FakeMigDevice | FakeMigHandle) -> str:
        return self._live(d).ci.uuid if isinstance(d, FakeMigHandle) else d.uuid

    def nvmlDeviceGetName(self, d: FakeMigDevice | FakeMigHandle) -> bytes:
        if not isinstance(d, FakeMigHandle):
            return d.product.encode()
        gi, ci = self._live(d).gi, d.ci
        part = f"{ci.slices}c." if ci.slices < gi.profile.compute_slices else ""
        return f"{d.device.product} MIG {part}{gi.profile.name}".encode()

    def nvmlDeviceGetMemoryInfo(self, d: FakeMigDevice | FakeMigHandle) -> Any:
        total = self._mib(self._live(d)) << 20 if isinstance(d, FakeMigHandle) else d.total_mib << 20
        return SimpleNamespace(total=total, used=0, free=total)

    def nvmlDeviceGetArchitecture(self, d: FakeMigDevice) -> int:
        return pynvml.NVML_DEVICE_ARCH_AMPERE

    def nvmlDeviceGetMigMode(self, d: FakeMigDevice) -> list[int]:
        if not d.has_mig:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if d.mig_enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceSetMigMode(self, d: FakeMigDevice, mode: int) -> int:
        self.mode_changes += 1
        raise AssertionError("carma changed a GPU's MIG mode")

    # ------------------------------------------------------------ readings (what `NvmlBackend` reads each second)

    def nvmlDeviceGetTemperature(self, d: FakeMigDevice, sensor: int) -> int:
        return 40

    def nvmlDeviceGetPowerUsage(self, d: FakeMigDevice) -> int:
        return 100_000

    def nvmlDeviceGetTotalEnergyConsumption(self, d: FakeMigDevice) -> int:
        return 5_000_000

    def nvmlDeviceGetComputeRunningProcesses(self, d: FakeMigDevice | FakeMigHandle) -> list[Any]:
        return []  # processes here are counted on compute instances (`run_process`), not named

    nvmlDeviceGetMPSComputeRunningProcesses = nvmlDeviceGetComputeRunningProcesses

    def nvmlShutdown(self) -> None:
        pass

    # ------------------------------------------------------------ MIG devices

    def nvmlDeviceGetMaxMigDeviceCount(self, d: FakeMigDevice) -> int:
        """As NVML: zero on a GPU without MIG or with MIG mode off, one per compute slice otherwise."""
        return d.geometry.compute_slices if d.has_mig and d.mig_enabled else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, d: FakeMigDevice, index: int) -> FakeMigHandle:
        self._mig(d)
        if not 0 <= index < self.nvmlDeviceGetMaxMigDeviceCount(d):
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        listed = d.mig_devices()
        if index >= len(listed):
            raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)
        return FakeMigHandle(d, *listed[index])

    def nvmlDeviceIsMigDeviceHandle(self, d: FakeMigDevice | FakeMigHandle) -> ctypes.c_uint:
        return ctypes.c_uint(isinstance(d, FakeMigHandle))  # nvidia-ml-py returns the c_uint itself

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, d: FakeMigDevice | FakeMigHandle) -> FakeMigDevice:
        return self._mig_handle(d).device

    def nvmlDeviceGetGpuInstanceId(self, d: FakeMigDevice | FakeMigHandle) -> int:
        return self._mig_handle(d).gi.id

    def nvmlDeviceGetComputeInstanceId(self, d: FakeMigDevice | FakeMigHandle) -> int:
        return self._mig_handle(d).ci.id

    def nvmlDeviceGetAttributes(self, d: FakeMigDevice | FakeMigHandle) -> Any:
        """A MIG device's engines and slices (NVML_ERROR_NOT_SUPPORTED on a GPU's handle)."""
        h = self._mig_handle(d)
        profile, attributes = h.gi.profile, pynvml.c_nvmlDeviceAttributes()
        attributes.multiprocessorCount = (profile.sms or 0) * h.ci.slices // profile.compute_slices
        attributes.gpuInstanceSliceCount = profile.compute_slices
        attributes.computeInstanceSliceCount = h.ci.slices
        attributes.memorySizeMB = self._mib(h)
        return attributes

    def _mig_handle(self, d: FakeMigDevice | FakeMigHandle) -> FakeMigHandle:
        if not isinstance(d, FakeMigHandle):
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return self._live(d)

    def _live(self, h: FakeMigHandle) -> FakeMigHandle:
        """The handle while its compute instance exists: NVML's MIG device handles go stale with it."""
        if h.gi not in h.device.instances or h.ci not in h.gi.computes:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return h

    @staticmethod
    def _mib(h: FakeMigHandle) -> int:
        """Its GPU instance's memory: the profile's as reported, else its share of the card's."""
        p = h.gi.profile
        return p.memory_mib or h.device.total_mib * p.memory_slices // h.device.geometry.memory_slices

    # ------------------------------------------------------------ GPU instances

    def _mig(self, d: FakeMigDevice, change: bool = False) -> None:
        if not d.has_mig or not d.mig_enabled:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if change and not self.privileged:
            raise nvml_error(pynvml.NVML_ERROR_NO_PERMISSION)

    def _profile(self, d: FakeMigDevice, profile_id: int) -> Any:
        for p in d.geometry.profiles:
            if p.profile_id == profile_id:
                return p
        raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def nvmlDeviceGetGpuInstanceProfileInfo(self, d: FakeMigDevice, constant: int) -> Any:
        self._mig(d)
        for p in d.geometry.profiles:
            if getattr(pynvml, p.nvml_profile) == constant:
                return SimpleNamespace(
                    id=p.profile_id,
                    sliceCount=p.compute_slices,
                    instanceCount=p.max_count,
                    multiprocessorCount=p.sms or 0,
                    memorySizeMB=p.memory_mib or 0,
                )
        raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, d: FakeMigDevice, profile_id: int, out: Any, count: Any):
        """Every placement the profile allows, taken or not, as NVML lists them; `out` None asks the count."""
        self._mig(d)
        p = self._profile(d, profile_id)
        if out is not None:
            for k, start in enumerate(p.starts):
                out[k].start, out[k].size = start, p.memory_slices
        _deref(count).value = len(p.starts)

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, d: FakeMigDevice, profile_id: int) -> int:
        """How many more instances of the profile fit now: in free memory slices, within its count."""
        self._mig(d)
        p = self._profile(d, profile_id)
        held, fits = d.held(), 0
        for start in p.starts:
            mask = ((1 << p.memory_slices) - 1) << start
            if not mask & held:
                held |= mask
                fits += 1
        existing = sum(1 for gi in d.instances if gi.profile.profile_id == profile_id)
        return min(fits, p.max_count - existing)

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, d: FakeMigDevice, profile_id: int, placement: Any) -> Any:
        self._mig(d, change=True)
        p = self._profile(d, profile_id)
        where = _deref(placement)
        if where.start not in p.starts or where.size != p.memory_slices:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self.nvmlDeviceGetGpuInstanceRemainingCapacity(d, profile_id) == 0 or (
            (((1 << p.memory_slices) - 1) << where.start) & d.held()
        ):
            raise nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        used = {gi.id for gi in d.instances}
        gi = FakeGpuInstance(next(k for k in range(1, 64) if k not in used), p, where.start)
        d.instances.append(gi)
        return self._handle(gi, pynvml.c_nvmlGpuInstance_t)

    def nvmlDeviceGetGpuInstances(self, d: FakeMigDevice, profile_id: int, out: Any, count: Any) -> None:
        self._mig(d)
        found = [gi for gi in d.instances if gi.profile.profile_id == profile_id]
        for k, gi in enumerate(found):
            out[k] = self._handle(gi, pynvml.c_nvmlGpuInstance_t)
        _deref(count).value = len(found)

    def nvmlDeviceGetGpuInstanceById(self, d: FakeMigDevice, gi_id: int) -> Any:
        self._mig(d)
        for gi in d.instances:
            if gi.id == gi_id:
                return self._handle(gi, pynvml.c_nvmlGpuInstance_t)
        raise nvml_error(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlGpuInstanceGetInfo(self, handle: Any) -> Any:
        gi = self._resolve(handle)
        placement = SimpleNamespace(start=gi.start, size=gi.profile.memory_slices)
        return SimpleNamespace(id=gi.id, profileId=gi.profile.profile_id, placement=placement)

    def nvmlGpuInstanceDestroy(self, handle: Any) -> None:
        gi = self._resolve(handle)
        device = next(d for d in self.devices if gi in d.instances)
        self._mig(device, change=True)
        if gi.computes:
            raise nvml_error(pynvml.NVML_ERROR_IN_USE)
        device.instances.remove(gi)
        self._handles = {a: h for a, h in self._handles.items() if h is not gi}

    # ------------------------------------------------------------ compute instances

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, handle: Any, constant: int, engine: int) -> Any:
        gi = self._resolve(handle)
        slices = {getattr(pynvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{n}_SLICE"): n for n in (1, 2, 3, 4, 7, 8, 6)}
        if engine != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED or constant not in slices:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        n = slices[constant]
        if n > gi.profile.compute_slices:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(id=constant, sliceCount=n, instanceCount=gi.profile.compute_slices // n)

    def nvmlGpuInstanceCreateComputeInstance(self, handle: Any, profile_id: int) -> Any:
        gi = self._resolve(handle)
        self._mig(next(d for d in self.devices if gi in d.instances), change=True)
        info = self.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            handle, profile_id, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        )
        if sum(c.slices for c in gi.computes) + info.sliceCount > gi.profile.compute_slices:
            raise nvml_error(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        used = {c.id for c in gi.computes}
        ci = FakeCompute(next(k for k in range(8) if k not in used), profile_id, info.sliceCount)
        gi.computes.append(ci)
        return self._handle(ci, pynvml.c_nvmlComputeInstance_t)

    def nvmlGpuInstanceGetComputeInstances(self, handle: Any, profile_id: int, out: Any, count: Any) -> None:
        gi = self._resolve(handle)
        found = [c for c in gi.computes if c.profile_id == profile_id]
        for k, ci in enumerate(found):
            out[k] = self._handle(ci, pynvml.c_nvmlComputeInstance_t)
        _deref(count).value = len(found)

    def nvmlComputeInstanceGetInfo(self, handle: Any) -> Any:
        ci = self._resolve(handle)
        return SimpleNamespace(id=ci.id, profileId=ci.profile_id)

    def nvmlComputeInstanceDestroy(self, handle: Any) -> None:
        ci = self._resolve(handle)
        gi = next(gi for d in self.devices for gi in d.instances if ci in gi.computes)
        self._mig(next(d for d in self.devices if gi in d.instances), change=True)
        if ci.processes:
            raise nvml_error(pynvml.NVML_ERROR_IN_USE)
        gi.computes.remove(ci)
        self._handles = {a: h for a, h in self._handles.items() if h is not ci}

    # ------------------------------------------------------------ handles and test helpers

    def _handle(self, obj: Any, kind: Any) -> Any:
        for address, known in self._handles.items():
            if known is obj:
                return ctypes.cast(ctypes.c_void_p(address), kind)
        self._next_address += 0x10
        self._handles[self._next_address] = obj
        return ctypes.cast(ctypes.c_void_p(self._next_address), kind)

    def _resolve(self, handle: Any) -> Any:
        try:
            return self._handles[_address(handle)]
        except KeyError:
            raise nvml_error(pynvml.NVML_ERROR_INVALID_ARGUMENT) from None

    def run_process(self, uuid: str, start: int) -> None:
        """A process starts on the compute instance of the GPU instance at this start."""
        gi = next(gi for gi in self.nvmlDeviceGetHandleByUUID(uuid).instances if gi.start == start)
        gi.computes[0].processes += 1
