"""Fake GPUs: the twin's GPU model running in wall-clock time, so the daemon can be tested without a GPU.

A fake device lives in a directory, so that the daemon (reading telemetry) and the fake jobs it launches
(`python -m carma.fakejob`, allocating memory and computing) share it across processes the way they share
a real GPU through its driver:

    root/device.json      the GPUs (index, name, memory, power limits, UUID), sharing mode, time scale
    root/device.lock      taken exclusively (flock) by every change, so allocations never over-commit
    root/procs/<pid>.json one registration per process: its memory on each GPU (by UUID) and its load
                          while computing (null before); written atomically, read without the lock
    root/generation       a token written anew after every change of the registry: a computing job asks
                          for its speed many times a second, and reads the registry only when it changed
    root/mig.json         the MIG instances of the GPUs made with MIG mode enabled (`--fake-mig`), by GPU:
                          profile, start, and the UUID of its compute instance once made; changed only through
                          `carma.telemetry.fakemig.FakeMigControl`, under the lock

Under a root daemon, which runs each task as its user, every user's fake jobs share the device: procs/ is
open to all and sticky (as /tmp), the lock and the token writable by all, and a registration counts only
when the process it names (or root) wrote it. Fake GPUs are a test tool: any local user can change what
they show.

The model is the twin's (see `carma.sim.twin`): an allocation fails when it exceeds the free memory less
a fragmentation allowance of what the co-runners hold; a computing process runs at its solo speed divided
by its largest slowdown over its GPUs; a GPU's SMACT/SMOCC/DRAMA are the computing processes' solo values
times their speed, capped at 1. Registrations of dead processes are ignored and removed (a SIGKILLed job
cannot clean up after itself), as the driver frees the memory of a process that exits.

A MIG GPU is listed as its instances (those with a compute instance, as NVML lists MIG devices), each holding
its profile's memory; a process on one runs at `carma.sim.migspeed.speed_on` of its solo speed, alone there.
Power and energy are read per physical GPU, so an instance's sample has none, as NVML gives none.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import secrets
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from carma.core.mig.geometry import Geometry
from carma.core.types import GpuSample, MigSlot, Target, TargetKind
from carma.sim.gpus import GpuType
from carma.sim.migspeed import speed_on
from carma.sim.models import SHARING_MODES, Load, calibrated_interference, calibrated_power
from carma.telemetry import DeviceReading, GpuProcess
from carma.userfiles import open_for_reading

ENV_ROOT = "CARMA_FAKE_GPUS"
ENV_TIME_SCALE = "CARMA_TIME_SCALE"
UUID_PREFIX = "GPU-fake-"
MIG_UUID_PREFIX = "MIG-fake-"

_PROC = Path("/proc")


@dataclass(frozen=True)
class _Registration:
    """One process's footprint on the device: MiB per GPU UUID, and its load once it computes."""

    pid: int
    mib: dict[str, int]
    load: Load | None


class FakeDevice:
    """A fake multi-GPU device in a directory, shared by every process that opens it."""

    def __init__(
        self,
        root: Path,
        gpus: Sequence[GpuType],
        uuids: Sequence[str],
        sharing: str,
        time_scale: float,
        fragmentation: float,
        mig: Sequence[bool] = (),
    ) -> None:
        self.root = root
        self.sharing = sharing
        self.time_scale = time_scale
        self.fragmentation = fragmentation
        self._kinds = list(gpus)
        self._uuids = list(uuids)
        self._mig = list(mig) or [False] * len(self._uuids)  # MIG mode enabled, per GPU
        self._procs = root / "procs"
        self._speeds: tuple[str, dict[int, float]] = ("", {})  # the generation they were computed at

    # ----------------------------------------------------------------- creating and opening

    @classmethod
    def create(
        cls,
        root: str | Path,
        gpus: Sequence[GpuType],
        sharing: str = "mps",
        time_scale: float = 1.0,
        fragmentation: float = 0.05,
        mig: bool = False,
    ) -> FakeDevice:
        """A fresh device at `root`, replacing any earlier one there (with its registrations). With `mig`, every
        GPU has MIG mode enabled, as an admin leaves it: no instances yet."""
        if not gpus:
            raise ValueError("a fake device needs at least one GPU")
        if sharing not in SHARING_MODES:
            raise ValueError(f"unknown sharing mode {sharing!r} (use {' or '.join(SHARING_MODES)})")
        if not 0 < time_scale < math.inf:
            raise ValueError(f"time scale must be positive and finite, got {time_scale}")
        if not 0 <= fragmentation < 1:
            raise ValueError(f"fragmentation must be in [0, 1), got {fragmentation}")
        root, time_scale = Path(root).resolve(), float(time_scale)
        token = secrets.token_hex(4)
        uuids = [f"{UUID_PREFIX}{i}-{token}" for i in range(len(gpus))]
        if mig:
            for kind in gpus:
                Geometry.of(kind.name)  # a GPU without MIG cannot be made with MIG mode on
        device = cls(root, gpus, uuids, sharing, time_scale, fragmentation, [mig] * len(gpus))
        device._procs.mkdir(parents=True, exist_ok=True)
        for stale in device._procs.glob("*.json"):
            stale.unlink(missing_ok=True)
        for name in ("device.lock", "generation"):
            (root / name).touch()
        if os.geteuid() == 0:  # a root daemon runs each task as its user, and each task's fake job uses the device
            os.chmod(root, 0o755)
            os.chmod(device._procs, 0o1777)  # as /tmp: every user registers, none removes another's registration
            for name in ("device.lock", "generation"):
                os.chmod(root / name, 0o666)
        _write_atomic(root / "mig.json", {})
        gpu_list = [
            {"index": i, "uuid": u, "mig": mig, **asdict(k)} for i, (k, u) in enumerate(zip(gpus, uuids, strict=True))
        ]
        description = {"gpus": gpu_list, "sharing": sharing, "time_scale": time_scale, "fragmentation": fragmentation}
        _write_atomic(root / "device.json", description)
        device._changed()
        return device

    @classmethod
    def open(cls, root: str | Path) -> FakeDevice:
        root = Path(root).resolve()
        try:
            description = json.loads((root / "device.json").read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no fake GPU device at {root} (create one with FakeDevice.create)") from None
        gpus = sorted(description["gpus"], key=lambda g: g["index"])
        kinds = [GpuType(g["name"], g["total_mib"], g["idle_w"], g["max_w"]) for g in gpus]
        uuids = [g["uuid"] for g in gpus]
        mig = [bool(g.get("mig", False)) for g in gpus]
        return cls(
            root, kinds, uuids, description["sharing"], description["time_scale"], description["fragmentation"], mig
        )

    # ----------------------------------------------------------------- what the device is

    def gpus(self) -> list[Target]:
        """The targets: each GPU without MIG mode, and the MIG instances of those with it."""
        return [t for t, _ in self._targets(self.layout())]

    def index_of(self, uuid: str) -> int:
        """The index of the GPU `uuid` is, or is a MIG instance of."""
        if uuid in self._uuids:
            return self._uuids.index(uuid)
        for parent, instances in self.layout().items():
            if any(i["ci"] == uuid for i in instances):
                return self._uuids.index(parent)
        raise ValueError(f"{uuid!r} is not a GPU of the fake device at {self.root}")

    @property
    def count(self) -> int:
        """How many physical GPUs it has."""
        return len(self._uuids)

    def kind(self, index: int) -> GpuType:
        return self._kinds[index]

    def uuid(self, index: int) -> str:
        return self._uuids[index]

    def mig_enabled(self, index: int) -> bool:
        return self._mig[index]

    def layout(self) -> dict[str, list[dict[str, object]]]:
        """The MIG instances of each MIG GPU (by UUID): `gi` (its GPU-instance id), `profile`, `start` and `ci`
        (its compute instance's UUID, None until made). Read without the lock: written atomically."""
        if not any(self._mig):
            return {}
        try:
            data = json.loads((self.root / "mig.json").read_text())
        except FileNotFoundError:
            data = {}
        return {u: list(data.get(u, [])) for u, on in zip(self._uuids, self._mig, strict=True) if on}

    @contextmanager
    def changing_layout(self) -> Iterator[dict[str, list[dict[str, object]]]]:
        """The layout, under the lock, written back when the block ends without an error."""
        with self._locked():
            layout = self.layout()
            yield layout
            _write_atomic(self.root / "mig.json", layout)
            self._changed()

    def _targets(self, layout: dict[str, list[dict[str, object]]]) -> list[tuple[Target, int]]:
        """Each target with the index of its GPU."""
        out = []
        for i, (kind, uuid) in enumerate(zip(self._kinds, self._uuids, strict=True)):
            if not self._mig[i]:
                out.append((Target(uuid, kind.name, kind.total_mib), i))
                continue
            geometry = Geometry.of(kind.name)
            for inst in sorted(layout[uuid], key=lambda x: int(str(x["start"]))):
                if inst["ci"] is None:
                    continue  # no compute instance yet: no MIG device to list
                profile = geometry.profile(str(inst["profile"]))
                slot = MigSlot(profile.name, int(str(inst["start"])))
                target = Target(
                    str(inst["ci"]),
                    f"{kind.name} {profile.name}",
                    profile.memory_mib or 0,
                    TargetKind.MIG,
                    parent=uuid,
                    compute=profile.compute_slices,
                    shareable=False,
                    slot=slot,
                )
                out.append((target, i))
        return out

    # ----------------------------------------------------------------- what processes do

    def allocate(self, pid: int, uuids: Sequence[str], total_mib: int) -> tuple[bool, str]:
        """Grow `pid`'s allocation on each of `uuids` to `total_mib`, all or nothing.

        Returns (True, "") or (False, the CUDA out-of-memory message PyTorch prints, naming the GPU by its
        ordinal within `uuids`, as CUDA_VISIBLE_DEVICES renumbers devices for the process).
        """
        with self._locked():
            totals = {t.id: t.total_mib for t, _ in self._targets(self.layout())}
            for uuid in uuids:
                if uuid not in totals:
                    raise ValueError(f"{uuid!r} is not a GPU of the fake device at {self.root}")
            regs = self._live()
            mine = next((r for r in regs if r.pid == pid), _Registration(pid, {}, None))
            for ordinal, uuid in enumerate(uuids):
                own = mine.mib.get(uuid, 0)
                request = total_mib - own
                used = sum(r.mib.get(uuid, 0) for r in regs)
                free = totals[uuid] - used
                if request > 0 and request > free - self.fragmentation * (used - own):
                    return False, oom_message(ordinal, request, totals[uuid], free)
            grown = {**mine.mib, **{u: max(total_mib, mine.mib.get(u, 0)) for u in uuids}}
            self._write(_Registration(pid, grown, mine.load))
        return True, ""

    def set_load(self, pid: int, load: Load | None) -> None:
        """Mark `pid` computing with `load` on all its GPUs, or (None) holding memory without computing."""
        with self._locked():
            mine = next((r for r in self._live() if r.pid == pid), None)
            if mine is None:
                raise ValueError(f"process {pid} holds no memory on the fake device at {self.root}")
            self._write(_Registration(pid, mine.mib, load))

    def release(self, pid: int) -> None:
        """Free everything `pid` holds, as the driver does when a process exits."""
        with self._locked():
            (self._procs / f"{pid}.json").unlink(missing_ok=True)
            self._changed()

    # ----------------------------------------------------------------- what the device shows

    def processes(self, uuid: str) -> list[tuple[int, int, Load | None]]:
        """(pid, used MiB, load or None) of the live processes holding memory on GPU `uuid`, by pid."""
        self.index_of(uuid)  # an unknown GPU is an error, not an idle one
        return [(r.pid, r.mib[uuid], r.load) for r in self._live() if r.mib.get(uuid, 0) > 0]

    def speed(self, pid: int) -> float:
        """`pid`'s speed as a fraction of its solo speed; 1 while it is not computing. Worked out again only
        when the registry changed: each job asks several times a wall second, and reading every job's file
        each time made N jobs cost N^2 reads."""
        generation = self._generation()
        if generation != self._speeds[0] or not generation:
            self._speeds = (generation, self._speeds_of(self._live(), self._targets(self.layout())))
        return self._speeds[1].get(pid, 1.0)

    def sample(self, uuid: str, now: float) -> GpuSample:
        return next(r.sample for r in self.readings(now) if r.sample.gpu == uuid)

    def readings(self, now: float) -> list[DeviceReading]:
        """Every target's sample and processes from one consistent look at the registry, in index order."""
        regs, targets = self._live(), self._targets(self.layout())
        speeds = self._speeds_of(regs, targets)
        return [
            DeviceReading(
                self._sample(target, index, regs, speeds, now),
                tuple(GpuProcess(r.pid, r.mib[target.id]) for r in regs if r.mib.get(target.id, 0) > 0),
            )
            for target, index in targets
        ]

    def _sample(
        self, target: Target, index: int, regs: Sequence[_Registration], speeds: dict[int, float], now: float
    ) -> GpuSample:
        uuid = target.id
        holders = [r for r in regs if r.mib.get(uuid, 0) > 0]
        computing = [(r.load, speeds[r.pid]) for r in holders if r.load is not None]
        smact = min(1.0, sum(load.smact * s for load, s in computing))
        smocc = min(1.0, sum(load.smocc * s for load, s in computing))
        drama = min(1.0, sum(load.drama * s for load, s in computing))
        gract = min(1.0, sum(load.gract * s for load, s in computing))
        used = sum(r.mib[uuid] for r in holders)
        power = calibrated_power().power_w(self._kinds[index], smact) if target.kind is TargetKind.GPU else None
        return GpuSample(uuid, now, used, target.total_mib, smact, smocc, drama, power, gract=gract)

    def _speeds_of(self, regs: Sequence[_Registration], targets: Sequence[tuple[Target, int]]) -> dict[int, float]:
        """Each computing process's speed: 1 / its largest slowdown among the targets it computes on. On a whole
        GPU the slowdown is the interference of its co-runners; on a MIG instance, its share of the GPU's
        compute and memory system, and of the PCIe link the GPU's busy instances divide."""
        model = calibrated_interference()
        worst: dict[int, float] = {}
        busy = {i: 0 for _, i in targets}
        for target, i in targets:
            if target.kind is TargetKind.MIG and any(r.load and r.mib.get(target.id, 0) > 0 for r in regs):
                busy[i] += 1
        for target, i in targets:
            running = [(r.pid, r.load) for r in regs if r.load is not None and r.mib.get(target.id, 0) > 0]
            if target.slot is None:
                slowdowns = model.slowdowns([load for _, load in running], self.sharing)
            else:
                geometry = Geometry.of(self._kinds[i].name)
                profile = geometry.profile(target.slot.profile)
                slowdowns = [1 / speed_on(load, profile, geometry, busy_instances=busy[i]) for _, load in running]
            for (pid, _), slowdown in zip(running, slowdowns, strict=True):
                worst[pid] = max(worst.get(pid, 1.0), slowdown)
        return {pid: 1.0 / slowdown for pid, slowdown in worst.items()}

    # ----------------------------------------------------------------- the registry

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / "device.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield  # closing the file drops the lock, also when the holder is interrupted

    def _live(self) -> list[_Registration]:
        """The registrations of live processes, by pid; those of dead ones are removed on the way."""
        regs = []
        for path in self._procs.glob("*.json"):
            reg = _read_registration(path)
            if reg is None:
                continue  # released while we listed, or not a registration a process of its owner made
            if not _alive(reg.pid):  # killed without releasing: its co-runners speed up
                with suppress(PermissionError):  # another user's, which only its owner or root may remove
                    path.unlink(missing_ok=True)
                self._changed()
                continue
            regs.append(reg)
        return sorted(regs, key=lambda r: r.pid)

    def _write(self, reg: _Registration) -> None:
        load = asdict(reg.load) if reg.load is not None else None
        _write_atomic(self._procs / f"{reg.pid}.json", {"pid": reg.pid, "mib": reg.mib, "load": load})
        self._changed()

    def _changed(self) -> None:
        """Mark the registry changed, after the change (a reader that saw the old token reads again). Written in
        place, so that a job of any user may write it: a reader that meets it half-written reads the registry
        again, as after any change."""
        with open(self.root / "generation", "w") as f:
            f.write(secrets.token_hex(8))

    def _generation(self) -> str:
        try:
            return (self.root / "generation").read_text()
        except FileNotFoundError:  # a device made before the token: read the registry every time
            return ""


class FakeGpuBackend:
    """The daemon's GPU backend over a fake device (the `carma.telemetry.GpuBackend` protocol)."""

    def __init__(self, root: str | Path) -> None:
        self.device = FakeDevice.open(root)
        self._energy: dict[str, tuple[float, float, float]] = {}  # gpu -> (time, power, joules) at last read

    def gpus(self) -> list[Target]:
        return self.device.gpus()

    def read(self, now: float) -> list[DeviceReading]:
        """The device's readings, with an energy counter like NVML's: joules since this backend started,
        each interval counted at the power of its start (the daemon reads once a second)."""
        readings = self.device.readings(now)
        stamped = []
        for r in readings:
            s = r.sample
            if s.power_w is None:  # a MIG instance: NVML reads power and energy of the whole GPU only
                stamped.append(r)
                continue
            then, power, joules = self._energy.get(s.gpu, (now, 0.0, 0.0))
            joules += power * max(0.0, now - then)
            self._energy[s.gpu] = (now, s.power_w, joules)
            stamped.append(DeviceReading(replace(s, energy_j=joules), r.processes))
        return stamped

    def missing(self) -> dict[str, tuple[str, ...]]:
        """Nothing: the fake device models every metric."""
        return {}

    def refresh(self) -> None:
        """Nothing to do: `gpus` reads the device's layout every time."""

    def close(self) -> None:
        """Nothing to let go of: the device is files, opened afresh on every read."""


def fake_env(root: str | Path) -> dict[str, str]:
    """What the daemon adds to every task's environment so that a fake job finds its device and clock."""
    device = FakeDevice.open(root)
    return {ENV_ROOT: str(device.root), ENV_TIME_SCALE: repr(device.time_scale)}


def oom_message(ordinal: int, request_mib: int, total_mib: int, free_mib: int) -> str:
    """The line PyTorch prints when a CUDA allocation does not fit (the format the twin uses too)."""
    return (
        "torch.OutOfMemoryError: CUDA out of memory. "
        f"Tried to allocate {request_mib / 1024:.2f} GiB. GPU {ordinal} has a total capacity of "
        f"{total_mib / 1024:.2f} GiB of which {max(free_mib, 0)} MiB is free."
    )


REGISTRATION_BYTES = 64 << 10  # a registration is a few hundred bytes
MAX_MIB = 1 << 30  # a PiB in MiB: beyond any GPU's memory


def _read_registration(path: Path) -> _Registration | None:
    """The registration in `path`, or None when it is gone or is not one that the process it names, or root,
    wrote (the folder is open to every user under a root daemon: a FIFO, a link or a file forged for another
    user's process is no registration, and never blocks the daemon's telemetry)."""
    try:
        with open_for_reading(path, single_link=False) as f:
            writer = os.fstat(f.fileno()).st_uid
            text = f.read(REGISTRATION_BYTES + 1)  # a sparse file of a terabyte costs its maker nothing
        if len(text) > REGISTRATION_BYTES:
            return None
        data = json.loads(text)
        pid, mib, load = data["pid"], data["mib"], data["load"]
        if path.name != f"{pid}.json" or writer not in (0, _owner(pid), os.geteuid()):
            return None
        held = {str(u): int(m) for u, m in mib.items()}
        if not all(0 <= m <= MAX_MIB for m in held.values()):  # no GPU holds more
            return None
        return _Registration(pid, held, None if load is None else Load(**load))
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None


def _owner(pid: int) -> int | None:
    """The uid a process runs as, None when it is gone."""
    try:
        return (_PROC / str(pid)).stat().st_uid
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Whether `pid` still runs. A zombie counts as dead: a process's GPU memory is freed when it exits,
    before its parent reaps it."""
    if _PROC.is_dir():
        try:
            stat = (_PROC / str(pid) / "stat").read_text()
        except OSError:
            return False
        return stat.rpartition(")")[2].split()[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_atomic(path: Path, data: object) -> None:
    """Write JSON so that readers without the lock see the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
