"""The partition manager: what each MIG GPU holds, and for a memory need the plan that gives it the
tightest instance.

Pure: states are values, a plan is computed from them and applied to them, nothing is read or written
elsewhere. The rule, after MIGM (seed 002, section 4): the tightest memory footprint (memory slices) whose
usable memory holds the need with the margin; an idle instance of it if one exists; else one created in free
slices if it fits there, else over idle instances destroyed for it (fusion of idle neighbours, fission of an
idle larger instance), the fewest destroyed first; among equals where it keeps the most full layouts
reachable (MIGM's FSM rule), and only then, of a footprint's compute sizes (1g.10gb and 2g.10gb), the most
compute slices (carma's, not MIGM's: a compute slice a smaller one leaves idle lies under its memory slices,
where no other instance can have it). A busy instance is never touched. A profile of more memory is never the
answer: on these geometries every slot a larger instance could take holds an allowed start of the tightest,
so when the tightest cannot be had, neither can a larger one (the tests check it) and the task waits, as in
MIGM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from carma.core.mig.geometry import Geometry, Profile


@dataclass(frozen=True, order=True)
class InstanceKey:
    """A GPU instance's identity while it exists: its GPU, its start and its profile. The core keys a MIG
    target on it; an instance destroyed and created again at the same start with the same profile is,
    for placement, the same target."""

    gpu: str
    start: int
    profile: str

    def __str__(self) -> str:
        return f"{self.gpu}/{self.profile}@{self.start}"


@dataclass(frozen=True)
class Instance:
    profile: Profile
    start: int
    busy: bool = False

    @property
    def end(self) -> int:
        """One past its last memory slice."""
        return self.start + self.profile.memory_slices

    def __repr__(self) -> str:
        return f"Instance({self.profile.name}@{self.start}{' busy' if self.busy else ''})"


class InvalidLayout(ValueError):
    """Instances the GPU would not accept together; the message says which rule they break."""


@dataclass(frozen=True)
class MigGpu:
    """One MIG GPU: its identity, its geometry and the GPU instances it holds (by start)."""

    uuid: str
    geometry: Geometry
    instances: tuple[Instance, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "instances", tuple(sorted(self.instances, key=lambda i: i.start)))
        if problem := _invalid(self.geometry, self.instances):
            raise InvalidLayout(f"GPU {self.uuid} ({self.geometry.model}): {problem}")

    def key(self, instance: Instance) -> InstanceKey:
        return InstanceKey(self.uuid, instance.start, instance.profile.name)

    def find(self, key: InstanceKey) -> Instance:
        for i in self.instances:
            if self.key(i) == key:
                return i
        raise KeyError(f"no instance {key} on GPU {self.uuid}")

    @property
    def occupied(self) -> int:
        """Its instances' slots as the geometry's bits."""
        g = self.geometry
        return g.bits(g.slot(i.profile, i.start) for i in self.instances)

    @property
    def reachable(self) -> int:
        return self.geometry.reachable(self.occupied)

    def marked(self, key: InstanceKey, busy: bool) -> MigGpu:
        """This GPU with one instance marked busy (a task runs on it) or idle."""
        target = self.find(key)
        return replace(self, instances=tuple(replace(i, busy=busy) if i is target else i for i in self.instances))

    def text(self) -> str:
        """The layout in one line, memory slices in order: `1g.5gb@0 busy | 1g.5gb@1 idle | free 2-3 | ...`."""
        parts, at = [], 0
        for i in self.instances:
            if i.start > at:
                parts.append(_free(at, i.start))
            parts.append(f"{i.profile.name}@{i.start} {'busy' if i.busy else 'idle'}")
            at = i.end
        if at < self.geometry.memory_slices:
            parts.append(_free(at, self.geometry.memory_slices))
        return " | ".join(parts)


def _free(start: int, end: int) -> str:
    return f"free {start}" if end - start == 1 else f"free {start}-{end - 1}"


def _invalid(geometry: Geometry, instances: Sequence[Instance]) -> str | None:
    """Why these instances cannot coexist on this geometry, or None when a full layout holds them."""
    counts: dict[str, int] = {}
    for i in instances:
        if i.start not in i.profile.starts:
            return f"{i.profile.name} may start at {list(i.profile.starts)}, not at {i.start}"
        counts[i.profile.name] = counts.get(i.profile.name, 0) + 1
        if counts[i.profile.name] > i.profile.max_count:
            return f"at most {i.profile.max_count} {i.profile.name} instance(s) per GPU"
    if geometry.reachable(geometry.bits(geometry.slot(i.profile, i.start) for i in instances)) == 0:
        shown = ", ".join(f"{i.profile.name}@{i.start}" for i in instances)
        return f"{shown} overlap: no layout the GPU accepts holds them"
    return None


# ------------------------------------------------------------------ plans


@dataclass(frozen=True)
class DestroyInstance:
    """Destroy an idle GPU instance (its compute instance first)."""

    key: InstanceKey


@dataclass(frozen=True)
class CreateInstance:
    """Create a GPU instance of this profile at this start, and one compute instance spanning it."""

    key: InstanceKey


Step = DestroyInstance | CreateInstance


@dataclass(frozen=True)
class Plan:
    """What to do for one request: the steps, in order, then run the task on `instance`. `after` is the GPU
    as the steps leave it (the instance idle: the caller marks it busy when the task starts)."""

    instance: InstanceKey
    profile: Profile = field(repr=False)
    steps: tuple[Step, ...]
    reachable: int  # full layouts reachable once the steps are done
    after: MigGpu

    @property
    def reconfigures(self) -> bool:
        return bool(self.steps)


class RefusalReason(StrEnum):
    TOO_LARGE = "need exceeds the largest profile"
    NO_IDLE_SLICES = "no idle slices"
    BLOCKED = "no legal place without touching busy instances"
    NO_MIG_GPU = "no MIG GPU"


@dataclass(frozen=True)
class Refusal:
    """Why no instance can be had now; `detail` is one line for people."""

    reason: RefusalReason
    detail: str


def plan(gpus: Sequence[MigGpu], need_mib: int, *, margin_mib: int = 0) -> Plan | Refusal:
    """The plan giving a task of `need_mib` (plus `margin_mib`) the tightest instance on any of `gpus`."""
    if need_mib <= 0 or margin_mib < 0:
        raise ValueError(f"a need must be positive and a margin not negative, got {need_mib} and {margin_mib} MiB")
    if not gpus:
        return Refusal(RefusalReason.NO_MIG_GPU, "no GPU has MIG mode enabled")
    want = need_mib + margin_mib
    sizes = {g.uuid: _tightest(g.geometry, want) for g in gpus}
    if not any(sizes.values()):
        largest = max((p.memory_mib or 0 for g in gpus for p in g.geometry.sizing), default=0)
        asked = f"{want} MiB (need {need_mib} + margin {margin_mib})" if margin_mib else f"{need_mib} MiB"
        return Refusal(RefusalReason.TOO_LARGE, f"{asked} is more than {largest} MiB, the largest instance")
    # The least memory first, across GPUs: the first footprint any GPU can give wins, so the ways to give larger
    # ones need not be weighed. A footprint's memory is its tightest profile's (cards report equal-slice profiles
    # a few MiB apart: that difference must not rank them).
    footprint = {uuid: ps[0].memory_mib or 0 for uuid, ps in sizes.items() if ps}
    for memory in sorted(set(footprint.values())):
        choices = (c for g in gpus if footprint.get(g.uuid) == memory for p in sizes[g.uuid] for c in _choices(g, p))
        best = min(choices, default=None, key=_Choice.order)
        if best is not None:
            return best.plan()
    return _refusal(gpus, sizes)


@dataclass(frozen=True)
class _Choice:
    gpu: MigGpu
    profile: Profile
    start: int
    destroyed: tuple[Instance, ...]
    reused: bool
    reachable: int

    def order(self) -> tuple[bool, int, int, int, str, int]:
        # Of one footprint: an idle instance as it is (no reconfiguration), then free slices, then the fewest idle
        # instances destroyed; among equals MIGM's rule, the most full layouts reachable, as it is what leaves
        # room for the tasks behind (taking compute first fills 2g.10gb@4, 2g.10gb@0 for two 10 GB tasks on an
        # A100-40GB and leaves no place for a 20 GB one). Only then the most compute slices: every compute slice
        # lies under the memory slices of the instance that has it, so one a smaller instance leaves idle no
        # other can have (a 1g.10gb@0 strands compute slice 1, a 2g.10gb@0 runs on it).
        return (
            not self.reused,
            len(self.destroyed),
            -self.reachable,
            -self.profile.compute_slices,
            self.gpu.uuid,
            self.start,
        )

    def plan(self) -> Plan:
        g = self.gpu
        key = InstanceKey(g.uuid, self.start, self.profile.name)
        if self.reused:
            return Plan(key, self.profile, (), self.reachable, g)
        kept = tuple(i for i in g.instances if i not in self.destroyed)
        after = replace(g, instances=(*kept, Instance(self.profile, self.start)))
        steps: tuple[DestroyInstance | CreateInstance, ...] = (
            *(DestroyInstance(g.key(i)) for i in self.destroyed),
            CreateInstance(key),
        )
        return Plan(key, self.profile, steps, self.reachable, after)


def _tightest(geometry: Geometry, want_mib: int) -> tuple[Profile, ...]:
    """The profiles that hold `want_mib` in the fewest memory slices, least memory first: one memory footprint,
    several compute sizes (a 1g.10gb and a 2g.10gb both take two memory slices). Grouped by slices, not by
    MiB: a card may report them a few MiB apart, and the placement rule, not that difference, must choose."""
    fits = geometry.holding(want_mib)
    return tuple(p for p in fits if p.memory_slices == fits[0].memory_slices) if fits else ()


def _choices(gpu: MigGpu, profile: Profile) -> list[_Choice]:
    """Every way to have an idle `profile` instance on this GPU without touching a busy one."""
    g = gpu.geometry
    now = gpu.reachable
    out = [_Choice(gpu, profile, i.start, (), True, now) for i in gpu.instances if i.profile == profile and not i.busy]
    count = sum(1 for i in gpu.instances if i.profile == profile)
    for start in profile.starts:
        end = start + profile.memory_slices
        over = tuple(i for i in gpu.instances if i.start < end and start < i.end)
        if any(i.busy for i in over) or any(i.profile == profile and i.start == start for i in over):
            continue  # a busy instance is in the way, or this is an idle instance already counted
        if count - sum(1 for i in over if i.profile == profile) >= profile.max_count:
            continue
        kept = (g.slot(i.profile, i.start) for i in gpu.instances if i not in over)
        reach = g.reachable(g.bits((*kept, g.slot(profile, start))))
        if reach:
            out.append(_Choice(gpu, profile, start, over, False, reach))
    return out


def _refusal(gpus: Sequence[MigGpu], sizes: dict[str, tuple[Profile, ...]]) -> Refusal:
    idle = [str(g.key(i)) for g in gpus for i in g.instances if not i.busy]
    if not idle and all(g.geometry.is_full(g.occupied) for g in gpus):
        return Refusal(RefusalReason.NO_IDLE_SLICES, "every MIG GPU is filled with busy instances")
    wanted = sorted({p.name for ps in sizes.values() for p in ps})
    seen = ", ".join(idle) if idle else "none"
    return Refusal(
        RefusalReason.BLOCKED, f"no {' / '.join(wanted)} fits beside the busy instances (idle instances: {seen})"
    )


# ------------------------------------------------------------------ applying


def apply(gpu: MigGpu, plan: Plan) -> MigGpu:
    """The GPU once `plan`'s steps are done, checked step by step as the GPU would check them: a busy
    instance refuses destruction, a create must fit. Equal to `plan.after` for a plan made on `gpu`."""
    state = gpu
    for step in plan.steps:
        if isinstance(step, DestroyInstance):
            target = state.find(step.key)
            if target.busy:
                raise InvalidLayout(f"{step.key} is busy: a busy instance is never destroyed")
            state = replace(state, instances=tuple(i for i in state.instances if i is not target))
        else:
            profile = state.geometry.profile(step.key.profile)
            state = replace(state, instances=(*state.instances, Instance(profile, step.key.start)))
    state.find(plan.instance)
    return state
