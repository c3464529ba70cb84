"""The `MigControl` of fake GPUs: MIG instances created and destroyed in a fake device's layout, so that the
daemon partitions MIG GPUs without one (`carma server --fake-gpus 1xA100-40GB --fake-mig --mig dynamic`).

It refuses what NVML refuses, with the same reasons as `carma.telemetry.mig.NvmlMigControl` words them: a
start the profile does not allow, memory slices already taken, a profile's count reached, compute slices
beyond the GPU's, and destroying an instance a process holds memory on. It never changes MIG mode: a fake
GPU is made with it on (`--fake-mig`) or off.
"""

from __future__ import annotations

import secrets

from carma.core.mig.control import GpuInstanceView, ReportedProfile
from carma.core.mig.geometry import Geometry, Profile
from carma.core.mig.partition import Instance, InvalidLayout, MigGpu
from carma.telemetry.fake import MIG_UUID_PREFIX, FakeDevice
from carma.telemetry.mig import REASONS, MigError, MigUnavailable

INVALID_ARGUMENT, NOT_FOUND, IN_USE, INSUFFICIENT_RESOURCES = 2, 6, 19, 23  # NVML's codes


class FakeMigControl:
    def __init__(self, device: FakeDevice) -> None:
        self.device = device

    # ------------------------------------------------------------ reading

    def mig_gpus(self) -> tuple[str, ...]:
        return tuple(self.device.uuid(i) for i in range(self.device.count) if self.device.mig_enabled(i))

    def product(self, gpu: str) -> tuple[str, int]:
        kind = self.device.kind(self._index(gpu))
        return kind.name, kind.total_mib

    def reported_profiles(self, gpu: str) -> tuple[ReportedProfile, ...]:
        return tuple(
            ReportedProfile(p.profile_id, p.memory_mib, p.sms or 0, p.max_count, _placements(p))
            for p in self._geometry(gpu).profiles
            if p.memory_mib is not None
        )

    def gpu_instances(self, gpu: str) -> tuple[GpuInstanceView, ...]:
        geometry = self._geometry(gpu)
        return tuple(_view(i, geometry) for i in self.device.layout()[gpu])

    # ------------------------------------------------------------ changing

    def create_gpu_instance(self, gpu: str, profile_id: int, start: int) -> int:
        geometry = self._geometry(gpu)
        what = f"GPU {gpu}: cannot create a GPU instance of profile {profile_id} at slice {start}"
        profile = next((p for p in geometry.profiles if p.profile_id == profile_id), None)
        if profile is None or start not in profile.starts:
            raise MigError(f"{what}: {REASONS[INVALID_ARGUMENT]}")
        with self.device.changing_layout() as layout:
            held = layout[gpu]
            if sum(i["profile"] == profile.name for i in held) >= profile.max_count:
                raise MigError(f"{what}: {REASONS[INSUFFICIENT_RESOURCES]}")
            try:
                MigGpu(gpu, geometry, (*_instances(held, geometry), Instance(profile, start)))
            except InvalidLayout:
                raise MigError(f"{what}: {REASONS[INSUFFICIENT_RESOURCES]}") from None
            gi = min(set(range(1, len(held) + 2)) - {int(str(i["gi"])) for i in held})  # NVML reuses freed ids
            held.append({"gi": gi, "profile": profile.name, "start": start, "ci": None})
        return gi

    def create_compute_instance(self, gpu: str, gi_id: int, compute_slices: int) -> int:
        what = f"GPU {gpu}: cannot create a {compute_slices}-slice compute instance in GPU instance {gi_id}"
        geometry = self._geometry(gpu)
        with self.device.changing_layout() as layout:
            inst = self._instance(layout[gpu], gpu, gi_id)
            profile = geometry.profile(str(inst["profile"]))
            if compute_slices != profile.compute_slices:
                raise MigError(f"{what}: carma's fake GPUs make one compute instance spanning its GPU instance")
            if inst["ci"] is not None:
                raise MigError(f"{what}: {REASONS[INSUFFICIENT_RESOURCES]}")
            inst["ci"] = f"{MIG_UUID_PREFIX}{self._index(gpu)}-{gi_id}-{secrets.token_hex(4)}"
        return 0

    def destroy_gpu_instance(self, gpu: str, gi_id: int) -> None:
        what = f"GPU {gpu}: cannot destroy GPU instance {gi_id}"
        with self.device.changing_layout() as layout:
            inst = self._instance(layout[gpu], gpu, gi_id)
            if inst["ci"] is not None and self.device.processes(str(inst["ci"])):
                raise MigError(f"{what}: {REASONS[IN_USE]}")
            layout[gpu].remove(inst)

    # ------------------------------------------------------------ the device

    def _index(self, gpu: str) -> int:
        for i in range(self.device.count):
            if self.device.uuid(i) == gpu:
                if not self.device.mig_enabled(i):
                    raise MigUnavailable(
                        f"GPU {gpu}: MIG mode is not enabled; fake GPUs have it when made with --fake-mig"
                    )
                return i
        raise MigError(f"GPU {gpu}: {REASONS[NOT_FOUND]}")

    def _geometry(self, gpu: str) -> Geometry:
        return Geometry.of(self.device.kind(self._index(gpu)).name)

    def _instance(self, held: list[dict[str, object]], gpu: str, gi_id: int) -> dict[str, object]:
        for inst in held:
            if inst["gi"] == gi_id:
                return inst
        raise MigError(f"GPU {gpu}: no GPU instance {gi_id}: {REASONS[NOT_FOUND]}")


def _placements(profile: Profile) -> tuple[tuple[int, int], ...]:
    return tuple((start, profile.memory_slices) for start in profile.starts)


def _profile(inst: dict[str, object], geometry: Geometry) -> Profile:
    return geometry.profile(str(inst["profile"]))


def _view(inst: dict[str, object], geometry: Geometry) -> GpuInstanceView:
    profile = _profile(inst, geometry)
    start = int(str(inst["start"]))
    return GpuInstanceView(
        int(str(inst["gi"])), profile.profile_id, start, profile.memory_slices, () if inst["ci"] is None else (0,)
    )


def _instances(held: list[dict[str, object]], geometry: Geometry) -> list[Instance]:
    return [Instance(_profile(i, geometry), int(str(i["start"]))) for i in held]
