"""A fake NVML with MIG semantics, for driving `NvmlMigControl` without a GPU.

It answers the MIG calls as NVML does, with nvidia-ml-py's own exception classes and ctypes structures:
a placement the profile does not allow is NVML_ERROR_INVALID_ARGUMENT, one overlapping a taken memory
slice (or past the profile's instance count) NVML_ERROR_INSUFFICIENT_RESOURCES, destroying a compute
instance a process runs on, or a GPU instance that still has compute instances, NVML_ERROR_IN_USE, any
change by an unprivileged caller NVML_ERROR_NO_PERMISSION, and any MIG call on a GPU whose MIG mode is
disabled NVML_ERROR_NOT_SUPPORTED. Instance handles are ctypes pointers, as the real list calls fill in.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

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


class FakeMigNvml:
    """The slice of pynvml `NvmlMigControl` uses. `privileged=False` makes every change NO_PERMISSION."""

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

    def nvmlDeviceGetUUID(self, d: FakeMigDevice) -> str:
        return d.uuid

    def nvmlDeviceGetName(self, d: FakeMigDevice) -> bytes:
        return d.product.encode()

    def nvmlDeviceGetMemoryInfo(self, d: FakeMigDevice) -> Any:
        return SimpleNamespace(total=d.total_mib << 20)

    def nvmlDeviceGetMigMode(self, d: FakeMigDevice) -> list[int]:
        if not d.has_mig:
            raise nvml_error(pynvml.NVML_ERROR_NOT_SUPPORTED)
        mode = pynvml.NVML_DEVICE_MIG_ENABLE if d.mig_enabled else pynvml.NVML_DEVICE_MIG_DISABLE
        return [mode, mode]

    def nvmlDeviceSetMigMode(self, d: FakeMigDevice, mode: int) -> int:
        self.mode_changes += 1
        raise AssertionError("carma changed a GPU's MIG mode")

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
