"""A job's speed on a MIG instance, from its solo profile on the whole GPU: the twin's model (issue 47, item 5).

An instance has a share of the GPU's compute (its SMs over a 7g's) and of its memory system (its memory
slices over 8: each slice brings its DRAM channels and L2). A job needs, over its run, a share of each,
read from its solo profile; an instance that gives less of one than the job needs stretches the job by the
ratio (a roofline over the whole run: kernels run asynchronously from the host, so host time that left the
GPU idle absorbs slower kernels until the instance is the bottleneck):

    slowdown = (1 - x) * max(1, compute / compute_share, bandwidth / memory_share) + x * sharers

- `compute`: the geometric mean of SMACT and SMOCC. SMACT (an SM holds at least one warp) overstates what
  an instance must supply: on fewer SMs the same warps share SMs at a higher occupancy (MIGM calls compute
  "a soft constraint" and folds warps onto fewer SMs). SMOCC (warps resident over the most an SM holds)
  understates it: occupancy cannot rise without bound before the pipes saturate or a block's registers
  cap it. The mean of the two is checked against the thesis's one MIG measurement of a compute-heavy job
  (below).
- `bandwidth`: DRAMA, the share of cycles the memory interface is busy. A memory-bound job on a 1g (1 of
  8 memory slices) keeps 1/(8 DRAMA) of its speed, more than 1/7 for any DRAMA below 7/8.
- `x`: the share of the solo run spent in host-device copies that nothing overlaps. PCIe is not
  partitioned: MIGM (section 5.1, after Tang et al., HPC Asia 2025) finds its bandwidth divided equally
  among the instances, so copies stretch by the number of busy instances on the GPU (`sharers`, an upper
  bound: it assumes they all copy at once). The catalog has no transfer share; it defaults to 0, which
  is what the thesis measured for training ("across all evaluated scenarios, we did not observe
  bottlenecks due to PCIe connectivity", section 4.4.4). MIGM's Needleman-Wunsch, 2.2x slower on seven
  busy 1g instances though its kernels fit one, is a transfer share of 0.2.

Checks against measurements (tests/test_mig_speed.py):

- Thesis (`shared/seeds/003`, A100-40GB): a 7g.40gb runs as fast as the GPU without MIG (section 4.4.1),
  so shares are relative to a 7g (98 SMs), not the 108 SMs of the whole chip.
- Thesis Table 4.4: ResNet152 at batch 32 (SMACT 0.82, SMOCC 0.36 by the catalog's relation) on 3 of the
  7 compute slices with the memory shared with a recommender that uses 4% of it: +33% time measured, +27%
  modelled. The recommender (SMACT 0.05) on the other 4 slices: +5% measured, +0% modelled (the memory
  system they share is not in this model: carma gives every instance its own). Not reproduced: the thesis
  found the same ResNet152 slower still on a 4g.20gb (Figure 4.9a), which it credits to the extra memory
  of the shared 7g; the model puts a 4g ahead of 3 slices unless DRAMA exceeds 0.64 (ResNet152's DRAMA
  is not reported) and has no term for memory capacity.
- Thesis section 4.4.1: ResNet26 on CIFAR-10 at batch 32, seven on seven 1g.5gb: +40% to +80% per epoch.
  The catalog's nearest profile (resnet18_cifar100_20e_2: SMACT 0.16, DRAMA 0.18) is modelled at +43%.

What is simplified: one number per resource for the whole run (phases that are compute-bound and phases
that are memory-bound are averaged, which errs fast); MIGM's memory-management overhead on small
instances (Table 3: allocating took 0.98 s on a 1g against 0.24 s) is left out; instances of one GPU do
not otherwise interfere, which is MIG's promise and what the thesis measured (section 4.2.1).

Reconfiguration time: NVML's reference documents the create and destroy calls but not their duration,
MIGM reconfigures "in the background" and reports no time, and no public measurement was found
(`shared/design/MIG.md`). `RECONFIGURATION_S` is the time of one step of a plan (one GPU instance with its
compute instance destroyed or created), 1 s by default, within a plausible range of 0.1 s to 5 s: a step
is a synchronous driver call that starts no process, so it is well above an NVML query (milliseconds)
and well below a task's own start-up, which follows it (the catalog's time to first kernel, 6 s to 36 s).
Experiments should sweep the range; measure it where a MIG-enabled GPU may be reconfigured (a lent card
may only be read).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from carma.core.mig.geometry import Geometry, Profile

RECONFIGURATION_S = 1.0  # one plan step: a GPU instance with its compute instance, destroyed or created
RECONFIGURATION_RANGE_S = (0.1, 5.0)  # plausible, not measured (see the module's docstring)


class SoloProfile(Protocol):
    """What the twin knows of a job alone on a whole GPU: DCGM's SMACT, SMOCC and DRAMA as fractions (a
    catalog `Workload` and the twin's `Load` both are one)."""

    @property
    def smact(self) -> float: ...
    @property
    def smocc(self) -> float: ...
    @property
    def drama(self) -> float: ...


@dataclass(frozen=True)
class Demand:
    """The shares of the whole GPU a job needs over its run, and of its run spent copying over PCIe."""

    compute: float
    bandwidth: float
    transfer: float = 0.0

    def __post_init__(self) -> None:
        for name in ("compute", "bandwidth", "transfer"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"a job's {name} share must be a fraction in [0, 1], not {value!r}")

    @classmethod
    def of(cls, solo: SoloProfile, transfer: float = 0.0) -> Demand:
        return cls(math.sqrt(solo.smact * solo.smocc), solo.drama, transfer)


@dataclass(frozen=True)
class Shares:
    """The shares of the whole GPU an instance gives: compute (SMs) and memory system (memory slices)."""

    compute: float
    memory: float

    def __post_init__(self) -> None:
        if not (0 < self.compute <= 1 and 0 < self.memory <= 1):
            raise ValueError(f"an instance's shares must be in (0, 1], not {self.compute!r} and {self.memory!r}")

    @classmethod
    def of(cls, profile: Profile, geometry: Geometry) -> Shares:
        """Compute by SMs over a 7g's where both are known (an H100's 3g has 60 of 132 SMs, more than 3/7),
        else by compute slices; memory by memory slices."""
        whole = max(geometry.profiles, key=lambda p: p.compute_slices)
        if profile.sms is not None and whole.sms is not None:
            compute = profile.sms / whole.sms
        else:
            compute = profile.compute_slices / geometry.compute_slices
        return cls(compute, profile.memory_slices / geometry.memory_slices)


def slowdown(demand: Demand, shares: Shares, sharers: int = 1) -> float:
    """How many times longer the job runs on an instance with these shares than alone on the whole GPU,
    with `sharers` busy instances on the GPU dividing its PCIe link (the job's own included)."""
    if sharers < 1:
        raise ValueError(f"PCIe is shared by at least the job's own instance, not {sharers}")
    bound = max(1.0, demand.compute / shares.compute, demand.bandwidth / shares.memory)
    return (1 - demand.transfer) * bound + demand.transfer * sharers


def speed_on(
    solo: SoloProfile, profile: Profile, geometry: Geometry, *, busy_instances: int = 1, transfer: float = 0.0
) -> float:
    """The job's speed on an instance of `profile`, as a fraction of its solo speed on the whole GPU."""
    return 1.0 / slowdown(Demand.of(solo, transfer), Shares.of(profile, geometry), busy_instances)


def reconfiguration_s(steps: int, step_s: float = RECONFIGURATION_S) -> float:
    """The time a plan of `steps` (instances destroyed plus created) takes; the steps run one after another."""
    if steps < 0:
        raise ValueError(f"a plan has a non-negative number of steps, not {steps}")
    if not (step_s >= 0 and math.isfinite(step_s)):
        raise ValueError(f"a reconfiguration step takes a non-negative number of seconds, not {step_s!r}")
    return steps * step_s
