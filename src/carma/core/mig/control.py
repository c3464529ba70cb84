"""The port through which a world creates and destroys MIG instances, and what is done through it: read a
GPU's layout as a `MigGpu`, carry out a reconfiguration's steps, and finish one a killed daemon left half done.

`carma.telemetry.mig.NvmlMigControl` is the real one (nvidia-ml-py), `carma.telemetry.fakemig.FakeMigControl`
the fake GPUs'; the tests also drive the real one over a fake NVML with MIG semantics. The daemon journals a
reconfiguration before its first step (`carma.server.mig`) and calls `finish` on the journaled one at start.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from carma.core.mig.geometry import Geometry
from carma.core.mig.partition import Instance, InstanceKey, MigGpu
from carma.core.types import MigSlot, Reconfigure


@dataclass(frozen=True)
class GpuInstanceView:
    """A GPU instance as NVML lists it: its id (NVML's, reused after destruction), profile, placement
    (start and size in memory slices) and the ids of its compute instances."""

    gi_id: int
    profile_id: int
    start: int
    size: int
    compute_instances: tuple[int, ...] = ()


@dataclass(frozen=True)
class ReportedProfile:
    """A GPU-instance profile as the card reports it (`nvmlDeviceGetGpuInstanceProfileInfo`)."""

    profile_id: int
    memory_mib: int
    sms: int
    max_count: int
    placements: tuple[tuple[int, int], ...]  # (start, size) pairs the card allows


class MigControl(Protocol):
    """Creating and destroying MIG instances on GPUs whose MIG mode an admin enabled. Never changes MIG
    mode. Errors are one line."""

    def mig_gpus(self) -> tuple[str, ...]:
        """The UUIDs of the GPUs with MIG mode enabled."""
        ...

    def product(self, gpu: str) -> tuple[str, int]:
        """The GPU's product name as NVML gives it, and its total memory in MiB."""
        ...

    def reported_profiles(self, gpu: str) -> tuple[ReportedProfile, ...]: ...

    def gpu_instances(self, gpu: str) -> tuple[GpuInstanceView, ...]: ...

    def create_gpu_instance(self, gpu: str, profile_id: int, start: int) -> int:
        """Create a GPU instance at this placement; its id."""
        ...

    def create_compute_instance(self, gpu: str, gi_id: int, compute_slices: int) -> int:
        """Create a compute instance of this many slices in the GPU instance; its id."""
        ...

    def destroy_gpu_instance(self, gpu: str, gi_id: int) -> None:
        """Destroy the GPU instance, its compute instances first. Refused while a process runs on it."""
        ...


class ForeignInstance(ValueError):
    """An instance on the GPU that the geometry does not describe (a profile or start it lacks)."""


def read_gpu(control: MigControl, gpu: str, geometry: Geometry, busy: Collection[InstanceKey] = ()) -> MigGpu:
    """The GPU's layout as NVML lists it; `busy`: the instances the core runs tasks on."""
    by_id = {p.profile_id: p for p in geometry.profiles}
    instances = []
    for view in control.gpu_instances(gpu):
        profile = by_id.get(view.profile_id)
        if profile is None:
            raise ForeignInstance(f"GPU {gpu}: GPU instance {view.gi_id} has profile {view.profile_id}, unknown here")
        instances.append(Instance(profile, view.start, InstanceKey(gpu, view.start, profile.name) in busy))
    return MigGpu(gpu, geometry, tuple(instances))


def geometry_of(control: MigControl, gpu: str) -> Geometry:
    """The GPU's geometry, with the memory and SMs the card reports: the figure a task must fit is the
    card's, which differs from the table's by a fraction of a GiB between drivers."""
    geometry = Geometry.for_product(*control.product(gpu))
    names = {p.profile_id: p.name for p in geometry.profiles}
    reported = {names[r.profile_id]: r for r in control.reported_profiles(gpu) if r.profile_id in names}
    return geometry.with_reported(
        {name: r.memory_mib for name, r in reported.items()}, {name: r.sms for name, r in reported.items()}
    )


def carry_out(control: MigControl, action: Reconfigure, geometry: Geometry) -> None:
    """Do the reconfiguration's steps in order: destroy its idle instances, then create each GPU instance with one
    compute instance spanning it."""
    for slot in action.destroy:
        control.destroy_gpu_instance(action.gpu, _gi_id(control, action.gpu, slot, geometry))
    for slot in action.create:
        profile = geometry.profile(slot.profile)
        gi_id = control.create_gpu_instance(action.gpu, profile.profile_id, slot.start)
        control.create_compute_instance(action.gpu, gi_id, profile.compute_slices)


def finish(control: MigControl, action: Reconfigure, geometry: Geometry) -> list[str]:
    """End consistent after a daemon was killed while carrying out `action`: a GPU instance left without its
    compute instance (no task can run on it) gets it when `action` meant to create it, and is destroyed when
    `action` was destroying it. Instances it did not reach stay as they are: the layout is valid either way and
    the placer plans from what exists. What was done, one line each."""
    done = []
    meant = {(s.start, geometry.profile(s.profile).profile_id): s for s in action.create}
    for view in control.gpu_instances(action.gpu):
        if view.compute_instances:
            continue
        slot = meant.get((view.start, view.profile_id))
        if slot is not None:
            control.create_compute_instance(action.gpu, view.gi_id, geometry.profile(slot.profile).compute_slices)
            done.append(f"GPU {action.gpu}: finished creating MIG instance {slot}")
        else:
            control.destroy_gpu_instance(action.gpu, view.gi_id)
            done.append(f"GPU {action.gpu}: destroyed GPU instance {view.gi_id} left without a compute instance")
    return done


def _gi_id(control: MigControl, gpu: str, slot: MigSlot, geometry: Geometry) -> int:
    profile_id = geometry.profile(slot.profile).profile_id
    for view in control.gpu_instances(gpu):
        if view.start == slot.start and view.profile_id == profile_id:
            return view.gi_id
    raise LookupError(f"GPU {gpu}: no GPU instance {slot} to destroy")
