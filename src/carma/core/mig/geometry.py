"""A MIG GPU's geometry: its profiles, the slots they may take, and the full layouts those rules allow.

A slot is where an instance sits: a start (memory-slice index) and a shape (memory and compute slices).
Two instances conflict when their memory slices overlap; that and the allowed starts are the whole rule
NVML applies (`nvmlDeviceGetGpuInstancePossiblePlacements_v2`: "creation of new GPU instance will fail if
there is overlap with the already occupied memory slices"). The full layouts are derived from it: every set
of non-conflicting slots to which no slot can be added. A partial layout is valid when some full layout
contains it; MIGM's reachability of a state is how many full layouts contain it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

from carma.core.mig.profiles import MODELS, ProfileRow

Profile = ProfileRow


@dataclass(frozen=True, order=True)
class Slot:
    """Where an instance sits: its first memory slice and its shape. `+me` and plain 1g share slots."""

    start: int
    memory_slices: int
    compute_slices: int

    @property
    def mask(self) -> int:
        """Its memory slices as bits."""
        return ((1 << self.memory_slices) - 1) << self.start


class UnknownModel(ValueError):
    """A GPU model with no MIG geometry here."""


@dataclass(frozen=True)
class Geometry:
    """One GPU model's MIG rules. Derived tables are computed once per geometry and kept."""

    model: str
    profiles: tuple[Profile, ...] = field(repr=False)
    memory_slices: int = 8
    compute_slices: int = 7

    @classmethod
    def of(cls, model: str) -> Geometry:
        try:
            return _GEOMETRIES[model]
        except KeyError:
            known = ", ".join(MODELS)
            raise UnknownModel(f"no MIG geometry for GPU model {model!r}; known: {known}") from None

    @classmethod
    def for_product(cls, product: str, total_mib: int) -> Geometry:
        """The geometry of a card as NVML names it ("NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3", "NVIDIA
        H200") with its total memory: the model of its family whose nominal size the memory matches (a card
        holds a little more than its nominal GB, never 10% more: an H100 NVL's 94 GB is no H100-80GB)."""
        total_gb = total_mib * 2**20 / 1e9
        for model in MODELS:
            family, nominal = model.split("-")
            if re.search(rf"\b{family}\b", product) and 0 <= total_gb / int(nominal.removesuffix("GB")) - 1 < 0.1:
                return cls.of(model)
        known = ", ".join(MODELS)
        raise UnknownModel(f"no MIG geometry for {product!r} with {total_mib} MiB; known: {known}")

    def profile(self, name: str) -> Profile:
        for p in self.profiles:
            if p.name == name:
                return p
        raise ValueError(f"{self.model} has no MIG profile {name!r}; its profiles: {self.names}")

    @property
    def names(self) -> str:
        return ", ".join(p.name for p in self.profiles)

    def slot(self, profile: Profile, start: int) -> Slot:
        return Slot(start, profile.memory_slices, profile.compute_slices)

    # ------------------------------------------------------------ derived tables

    @cached_property
    def slots(self) -> tuple[Slot, ...]:
        """Every slot any profile may take, each once."""
        return tuple(sorted({self.slot(p, s) for p in self.profiles for s in p.starts}))

    @cached_property
    def _slot_bit(self) -> dict[Slot, int]:
        return {slot: 1 << i for i, slot in enumerate(self.slots)}

    @cached_property
    def layouts(self) -> tuple[frozenset[Slot], ...]:
        """The full layouts: sets of non-overlapping slots, within the compute slices, that no slot extends."""
        slots = self.slots
        found: list[frozenset[Slot]] = []

        def extend(chosen: list[Slot], memory: int, compute: int, first: int) -> None:
            # Slots are tried in order from `first`, so each set is built once; a set is full when no slot
            # at all (earlier ones included) still fits beside it.
            for i in range(first, len(slots)):
                s = slots[i]
                if not s.mask & memory and compute + s.compute_slices <= self.compute_slices:
                    extend([*chosen, s], memory | s.mask, compute + s.compute_slices, i + 1)
            if not any(self._fits(s, memory, compute) for s in slots):
                found.append(frozenset(chosen))

        extend([], 0, 0, 0)
        return tuple(found)

    def _fits(self, slot: Slot, memory: int, compute: int) -> bool:
        return not slot.mask & memory and compute + slot.compute_slices <= self.compute_slices

    @cached_property
    def _layout_bits(self) -> tuple[int, ...]:
        return tuple(self.bits(layout) for layout in self.layouts)

    def bits(self, slots: Iterable[Slot]) -> int:
        """A set of slots as one integer, the key reachability is looked up by."""
        bit = self._slot_bit
        out = 0
        for s in slots:
            out |= bit[s]
        return out

    @cached_property
    def _reach(self) -> dict[int, int]:
        """Reachability of every valid state, counted once: each full layout adds one to each of its
        subsets (at most 2^7 of them: seven instances fill a GPU)."""
        reach: dict[int, int] = {}
        for layout in self._layout_bits:
            sub = layout
            while True:
                reach[sub] = reach.get(sub, 0) + 1
                if sub == 0:
                    break
                sub = (sub - 1) & layout
        return reach

    def reachable(self, occupied: int) -> int:
        """MIGM's future configuration reachability: how many full layouts contain these slots (as `bits`).
        Zero means the state is not valid: the GPU accepts no layout that holds it."""
        return self._reach.get(occupied, 0)

    @cached_property
    def _full(self) -> frozenset[int]:
        return frozenset(self._layout_bits)

    def is_full(self, occupied: int) -> bool:
        """Whether these slots are a full layout: no instance of any profile fits beside them."""
        return occupied in self._full

    # ------------------------------------------------------------ sizing

    @cached_property
    def sizing(self) -> tuple[Profile, ...]:
        """The profiles a task may be given, tightest first: by usable memory, then compute slices. The order
        among profiles of one memory footprint (1g.10gb, 2g.10gb) is no preference: the partition manager weighs
        them all by where they fit (`partition.plan`). `+me` profiles and those whose memory no source gave are
        left out."""
        usable = [p for p in self.profiles if not p.media and p.memory_mib is not None]
        return tuple(sorted(usable, key=lambda p: (p.memory_mib, p.compute_slices)))

    def holding(self, need_mib: int) -> tuple[Profile, ...]:
        """The profiles whose memory holds `need_mib`, tightest first."""
        return tuple(p for p in self.sizing if p.memory_mib is not None and p.memory_mib >= need_mib)

    def next_larger(self, profile: Profile) -> Profile | None:
        """The tightest profile with more memory than `profile`: its memory is the need an out-of-memory crash on
        `profile` restarts with (which profile of its footprint the task gets, the partition manager decides)."""
        for p in self.sizing:
            if p.memory_mib is not None and profile.memory_mib is not None and p.memory_mib > profile.memory_mib:
                return p
        return None

    def with_reported(self, memory_mib: Mapping[str, int], sms: Mapping[str, int] | None = None) -> Geometry:
        """This geometry with the memory (and SMs) a card reports for its profiles, by name: drivers differ
        from the table by a fraction of a GiB, and the card's own figure is the one a task must fit."""
        sms = sms or {}
        profiles = tuple(
            replace(p, memory_mib=memory_mib.get(p.name, p.memory_mib), sms=sms.get(p.name, p.sms))
            for p in self.profiles
        )
        return Geometry(self.model, profiles, self.memory_slices, self.compute_slices)


_GEOMETRIES = {model: Geometry(model, rows) for model, rows in MODELS.items()}
