"""Creating and destroying MIG instances through nvidia-ml-py: the real `MigControl`.

It touches only GPUs whose MIG mode an admin enabled and never changes MIG mode (that needs a GPU reset
and is an admin's decision). Managing instances needs root, or read access to the `mig/config`
capability; without it, it refuses at start in one line rather than at the first reconfiguration.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import Any

from carma.core.mig.control import GpuInstanceView, ReportedProfile
from carma.core.mig.profiles import MODELS
from carma.telemetry.nvml import MIB, _text, load_nvml

MIG_CONFIG = "/proc/driver/nvidia/capabilities/mig/config"
GI_PROFILES = sorted({row.nvml_profile for rows in MODELS.values() for row in rows})
CI_PROFILES = {1: "1_SLICE", 2: "2_SLICE", 3: "3_SLICE", 4: "4_SLICE", 7: "7_SLICE"}  # compute slices -> constant
REASONS = {  # NVML's codes for MIG calls, in words (without the driver loaded nvidia-ml-py prints only the code)
    2: "not a placement or profile this GPU allows (NVML_ERROR_INVALID_ARGUMENT)",
    3: "not supported here (NVML_ERROR_NOT_SUPPORTED)",
    4: "not permitted (NVML_ERROR_NO_PERMISSION)",
    6: "not found (NVML_ERROR_NOT_FOUND)",
    19: "in use: a process runs on it (NVML_ERROR_IN_USE)",
    23: "its memory slices are taken or its profile's count is reached (NVML_ERROR_INSUFFICIENT_RESOURCES)",
}


class MigUnavailable(RuntimeError):
    """MIG instances cannot be managed here: not privileged, or MIG mode not enabled; one line says which."""


class MigError(RuntimeError):
    """A MIG call NVML refused (a placement taken or not allowed, an instance in use); one line."""


def privileged() -> bool:
    """Root, or read access to the capability NVIDIA grants MIG management through."""
    return os.geteuid() == 0 or os.access(MIG_CONFIG, os.R_OK)


class NvmlMigControl:
    """The `MigControl` of real GPUs."""

    def __init__(self, nvml: Any | None = None, is_privileged: Callable[[], bool] = privileged) -> None:
        if not is_privileged():
            raise MigUnavailable(
                f"managing MIG instances needs root or read access to {MIG_CONFIG}; this is uid {os.geteuid()}"
            )
        self._nvml = nvml if nvml is not None else load_nvml()

    # ------------------------------------------------------------ reading

    def mig_gpus(self) -> tuple[str, ...]:
        nvml = self._nvml
        found = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            if self._mode(handle) == nvml.NVML_DEVICE_MIG_ENABLE:
                found.append(_text(nvml.nvmlDeviceGetUUID(handle)))
        return tuple(found)

    def product(self, gpu: str) -> tuple[str, int]:
        nvml, handle = self._nvml, self._device(gpu)
        return _text(nvml.nvmlDeviceGetName(handle)), nvml.nvmlDeviceGetMemoryInfo(handle).total // MIB

    def reported_profiles(self, gpu: str) -> tuple[ReportedProfile, ...]:
        handle = self._device(gpu)
        out = []
        for info in self._profile_infos(handle):
            placements = self._placements(handle, info.id)
            out.append(
                ReportedProfile(info.id, info.memorySizeMB, info.multiprocessorCount, info.instanceCount, placements)
            )
        return tuple(out)

    def gpu_instances(self, gpu: str) -> tuple[GpuInstanceView, ...]:
        nvml, handle = self._nvml, self._device(gpu)
        views = []
        for info in self._profile_infos(handle):
            for gi in self._listed(
                nvml.nvmlDeviceGetGpuInstances, handle, info.id, nvml.c_nvmlGpuInstance_t, info.instanceCount
            ):
                gi_info = nvml.nvmlGpuInstanceGetInfo(gi)
                cis = tuple(nvml.nvmlComputeInstanceGetInfo(ci).id for ci in self._compute_instances(gi))
                placement = gi_info.placement
                views.append(GpuInstanceView(gi_info.id, gi_info.profileId, placement.start, placement.size, cis))
        return tuple(sorted(views, key=lambda v: v.start))

    # ------------------------------------------------------------ changing

    def create_gpu_instance(self, gpu: str, profile_id: int, start: int) -> int:
        nvml, handle = self._nvml, self._device(gpu)
        sizes = dict(self._placements(handle, profile_id))
        if start not in sizes:
            raise MigError(f"GPU {gpu}: profile {profile_id} may start at {sorted(sizes)}, not at {start}")
        placement = nvml.c_nvmlGpuInstancePlacement_t(start, sizes[start])
        gi = self._call(
            f"GPU {gpu}: cannot create a GPU instance of profile {profile_id} at slice {start}",
            nvml.nvmlDeviceCreateGpuInstanceWithPlacement,
            handle,
            profile_id,
            ctypes.byref(placement),
        )
        return nvml.nvmlGpuInstanceGetInfo(gi).id

    def create_compute_instance(self, gpu: str, gi_id: int, compute_slices: int) -> int:
        nvml = self._nvml
        gi = self._gpu_instance(gpu, gi_id)
        what = f"GPU {gpu}: cannot create a {compute_slices}-slice compute instance in GPU instance {gi_id}"
        constant = getattr(nvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{CI_PROFILES.get(compute_slices, '?')}", None)
        if constant is None:
            raise MigError(f"{what}: no compute-instance profile of {compute_slices} slices")
        info = self._call(
            what,
            nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo,
            gi,
            constant,
            nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
        )
        ci = self._call(what, nvml.nvmlGpuInstanceCreateComputeInstance, gi, info.id)
        return nvml.nvmlComputeInstanceGetInfo(ci).id

    def destroy_gpu_instance(self, gpu: str, gi_id: int) -> None:
        nvml = self._nvml
        gi = self._gpu_instance(gpu, gi_id)
        what = f"GPU {gpu}: cannot destroy GPU instance {gi_id}"
        for ci in self._compute_instances(gi):
            self._call(what, nvml.nvmlComputeInstanceDestroy, ci)
        self._call(what, nvml.nvmlGpuInstanceDestroy, gi)

    # ------------------------------------------------------------ NVML

    def _mode(self, handle: Any) -> int | None:
        """The current MIG mode, or None for a GPU without MIG."""
        nvml = self._nvml
        try:
            return nvml.nvmlDeviceGetMigMode(handle)[0]
        except nvml.NVMLError_NotSupported:
            return None

    def _device(self, gpu: str) -> Any:
        """The GPU's handle, once its MIG mode is seen enabled: carma never enables it itself."""
        nvml = self._nvml
        handle = self._call(f"GPU {gpu}", nvml.nvmlDeviceGetHandleByUUID, gpu)
        mode = self._mode(handle)
        if mode is None:
            raise MigUnavailable(f"GPU {gpu} has no MIG")
        if mode != nvml.NVML_DEVICE_MIG_ENABLE:
            raise MigUnavailable(
                f"GPU {gpu}: MIG mode is not enabled; an admin enables it (nvidia-smi -i N -mig 1), carma never does"
            )
        return handle

    def _profile_infos(self, handle: Any) -> list[Any]:
        """The GPU-instance profiles this card has, among those carma knows."""
        nvml = self._nvml
        infos = []
        for name in GI_PROFILES:
            try:
                infos.append(nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, getattr(nvml, name)))
            except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
                continue  # a profile this card lacks
        return infos

    def _placements(self, handle: Any, profile_id: int) -> tuple[tuple[int, int], ...]:
        nvml = self._nvml
        count = ctypes.c_uint(0)
        what = f"cannot read the placements of profile {profile_id}"
        self._call(what, nvml.nvmlDeviceGetGpuInstancePossiblePlacements, handle, profile_id, None, ctypes.byref(count))
        placements = (nvml.c_nvmlGpuInstancePlacement_t * count.value)()
        self._call(
            what, nvml.nvmlDeviceGetGpuInstancePossiblePlacements, handle, profile_id, placements, ctypes.byref(count)
        )
        return tuple((p.start, p.size) for p in placements[: count.value])

    def _gpu_instance(self, gpu: str, gi_id: int) -> Any:
        return self._call(
            f"GPU {gpu}: no GPU instance {gi_id}", self._nvml.nvmlDeviceGetGpuInstanceById, self._device(gpu), gi_id
        )

    def _compute_instances(self, gi: Any) -> list[Any]:
        nvml = self._nvml
        found = []
        for suffix in CI_PROFILES.values():
            constant = getattr(nvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{suffix}")
            try:
                info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, constant, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                )
            except (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument):
                continue  # larger than this GPU instance
            found += self._listed(
                nvml.nvmlGpuInstanceGetComputeInstances, gi, info.id, nvml.c_nvmlComputeInstance_t, info.instanceCount
            )
        return found

    def _listed(self, call: Callable[..., Any], owner: Any, profile_id: int, kind: Any, most: int) -> list[Any]:
        """The handles an NVML list call fills in, for an array of `most`."""
        handles = (kind * most)()
        count = ctypes.c_uint(most)
        self._call("cannot list MIG instances", call, owner, profile_id, handles, ctypes.byref(count))
        return list(handles[: count.value])

    def _call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """An NVML call whose error is a one-line MigError saying what was being done."""
        try:
            return fn(*args)
        except self._nvml.NVMLError as e:
            reason = REASONS.get(e.value, str(e))
        # Raised outside the handler, so no NVMLError is chained: its __eq__ fails against other exceptions.
        raise MigError(f"{what}: {reason}")
