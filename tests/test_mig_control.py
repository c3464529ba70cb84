"""The real MIG port (`NvmlMigControl`) over a fake NVML with MIG semantics: the checks at start, reading a
card's profiles and layout, creating and destroying with placements, refusals as NVML gives them, and a
plan carried out leaving the layout the partition manager predicted."""

from __future__ import annotations

import ctypes
import os
import re

import pynvml
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carma.core.mig.control import GpuInstanceView, carry_out, geometry_of, read_gpu
from carma.core.mig.geometry import Geometry
from carma.core.mig.partition import InstanceKey, Plan, plan
from carma.core.mig.placer import reconfigure
from carma.telemetry.mig import MigError, MigUnavailable, NvmlMigControl
from fake_mig_nvml import FakeMigDevice, FakeMigNvml

A100 = Geometry.of("A100-40GB")
GIB = 1024


def a100(uuid: str = "GPU-a", **kw) -> FakeMigDevice:
    return FakeMigDevice(uuid, "NVIDIA A100-SXM4-40GB", 40960, A100, **kw)


def control(*devices: FakeMigDevice, privileged: bool = True) -> tuple[NvmlMigControl, FakeMigNvml]:
    nvml = FakeMigNvml(list(devices) or [a100()], privileged=privileged)
    return NvmlMigControl(nvml, is_privileged=lambda: True), nvml


def test_an_unprivileged_user_is_refused_at_start_in_one_line():
    with pytest.raises(MigUnavailable, match=re.escape("needs root or read access to /proc/driver/nvidia/capabil")):
        NvmlMigControl(FakeMigNvml([a100()]), is_privileged=lambda: False)


def test_a_change_nvml_refuses_is_a_one_line_error():
    mig, _ = control(privileged=False)  # carma thought itself privileged, NVML disagrees (a container, say)
    message = (
        "GPU GPU-a: cannot create a GPU instance of profile 9 at slice 4: not permitted (NVML_ERROR_NO_PERMISSION)"
    )
    with pytest.raises(MigError, match=re.escape(message)):
        mig.create_gpu_instance("GPU-a", 9, 4)


def test_a_gpu_whose_mig_mode_is_off_is_left_alone_and_its_mode_never_changed():
    mig, nvml = control(a100("GPU-on"), a100("GPU-off", mig_enabled=False), a100("GPU-none", has_mig=False))
    assert mig.mig_gpus() == ("GPU-on",)
    with pytest.raises(MigUnavailable, match="GPU GPU-off: MIG mode is not enabled; an admin enables it"):
        mig.create_gpu_instance("GPU-off", 19, 0)
    with pytest.raises(MigUnavailable, match="GPU GPU-none has no MIG"):
        mig.gpu_instances("GPU-none")
    assert nvml.mode_changes == 0 and nvml.devices[1].instances == []


def test_the_cards_profiles_and_placements_are_read_and_replace_the_table():
    device = a100()
    device.geometry = A100.with_reported({"1g.5gb": 4800})  # this driver reports a little less
    mig, _ = control(device)
    reported = {r.profile_id: r for r in mig.reported_profiles("GPU-a")}
    assert reported[9].placements == ((0, 4), (4, 4)) and reported[0].placements == ((0, 8),)
    assert reported[19].memory_mib == 4800 and reported[19].max_count == 7
    geometry = geometry_of(mig, "GPU-a")
    assert geometry.model == "A100-40GB" and geometry.profile("1g.5gb").memory_mib == 4800


def test_create_list_and_destroy_with_placements():
    mig, _ = control()
    gi = mig.create_gpu_instance("GPU-a", 9, 4)
    ci = mig.create_compute_instance("GPU-a", gi, 3)
    one = mig.create_gpu_instance("GPU-a", 19, 0)
    assert mig.gpu_instances("GPU-a") == (GpuInstanceView(one, 19, 0, 1, ()), GpuInstanceView(gi, 9, 4, 4, (ci,)))
    mig.destroy_gpu_instance("GPU-a", gi)
    assert [v.gi_id for v in mig.gpu_instances("GPU-a")] == [one]


@pytest.mark.parametrize(
    ("profile", "start", "message"),
    [
        (9, 2, "profile 9 may start at [0, 4], not at 2"),
        (5, 0, "at slice 0: its memory slices are taken or its profile's count is reached"),
    ],
)
def test_illegal_or_taken_placements_are_refused(profile, start, message):
    mig, _ = control()
    mig.create_gpu_instance("GPU-a", 19, 1)
    with pytest.raises(MigError, match=re.escape(message)):
        mig.create_gpu_instance("GPU-a", profile, start)


def test_the_fake_refuses_placements_as_nvml_does():
    nvml = FakeMigNvml([a100()])
    device = nvml.devices[0]
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
            device, 9, ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(2, 4))
        )
    nvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, 9, ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(4, 4)))
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
            device, 19, ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(5, 1))
        )
    capacity = {pid: nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, pid) for pid in (19, 15, 14, 9, 5, 0)}
    assert capacity == {19: 4, 15: 2, 14: 2, 9: 1, 5: 1, 0: 0}  # beside a 3g.20gb at slice 4


def test_a_busy_instance_cannot_be_destroyed():
    mig, nvml = control()
    gi = mig.create_gpu_instance("GPU-a", 14, 2)
    mig.create_compute_instance("GPU-a", gi, 2)
    nvml.run_process("GPU-a", 2)
    with pytest.raises(MigError, match=re.escape(f"cannot destroy GPU instance {gi}: in use: a process runs on it")):
        mig.destroy_gpu_instance("GPU-a", gi)
    assert [v.gi_id for v in mig.gpu_instances("GPU-a")] == [gi]


def test_a_plan_carried_out_through_the_port_is_the_layout_predicted():
    mig, nvml = control()
    busy: set[InstanceKey] = set()
    for need in (4 * GIB, 15 * GIB, 9 * GIB):
        state = read_gpu(mig, "GPU-a", A100, busy)
        decision = plan([state], need)
        assert isinstance(decision, Plan)
        carry_out(mig, reconfigure(decision), A100)
        assert read_gpu(mig, "GPU-a", A100, busy) == decision.after
        busy.add(decision.instance)
        nvml.run_process("GPU-a", decision.instance.start)
    assert all(i.busy for i in read_gpu(mig, "GPU-a", A100, busy).instances)


SETTINGS = settings(
    max_examples=int(os.environ.get("CARMA_HYPOTHESIS_EXAMPLES", 150)) // 3,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@SETTINGS
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("request"), st.integers(1, 40 * GIB)), st.tuples(st.just("end"), st.integers(0, 99))
        ),
        max_size=25,
    )
)
def test_random_plans_through_the_port_end_where_predicted(ops):
    mig, nvml = control()
    busy: list[InstanceKey] = []
    for kind, value in ops:
        if kind == "end":
            if busy:  # the task's process exits: its instance is idle, free to reuse, fuse or split
                key = busy.pop(value % len(busy))
                gi = next(g for g in nvml.devices[0].instances if g.start == key.start)
                gi.computes[0].processes -= 1
            continue
        state = read_gpu(mig, "GPU-a", A100, busy)
        decision = plan([state], value)
        if not isinstance(decision, Plan):
            continue
        carry_out(mig, reconfigure(decision), A100)  # NVML itself refuses to destroy a busy instance: this would raise
        assert read_gpu(mig, "GPU-a", A100, busy) == decision.after
        busy.append(decision.instance)
        nvml.run_process("GPU-a", decision.instance.start)
