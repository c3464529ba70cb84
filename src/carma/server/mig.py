"""The daemon's dynamic MIG (`carma server --mig dynamic`): it carries out the core's `Reconfigure` actions on
GPUs whose MIG mode an admin enabled, through a `MigControl` (NVML's, or the fake GPUs').

A reconfiguration is journaled in the store before its first step and cleared after its last, in the same
transaction that keeps it for the timeline, so a daemon killed in the middle finds at its next start what it
meant to do and ends consistent (`control.finish`): a GPU instance left without its compute instance is
completed or destroyed; nothing else needs undoing, as every layout between two steps is valid. A step the
GPU refuses (a process that is not carma's started on an instance) ends the reconfiguration where it is: the
placer plans again from the layout as it then is.

Each reconfiguration, carried out, refused or found interrupted at a start, is kept in the store for the
dashboard's timeline, as long as ended tasks are (`[server] keep_ended_days`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from carma.core.mig.control import MigControl, carry_out, finish, geometry_of
from carma.core.mig.geometry import Geometry, UnknownModel
from carma.core.types import MigSlot, Reconfigure, TargetId
from carma.server.faults import WORLD_FAULTS, FaultLog
from carma.server.store import Reconfiguration, Store
from carma.telemetry.mig import MigError, MigUnavailable

log = logging.getLogger("carma.mig")

JOURNAL = "mig_reconfiguration"  # the store's meta key of the reconfiguration under way
JOURNALING = "journaling a MIG reconfiguration"


class MigManager:
    """Carries out reconfigurations, counts them and keeps their history; `refresh` makes the GPU backend list the
    new layout, `clock` is the daemon's (the timeline's times), and the history is kept `keep_s` seconds (None:
    for good, as ended tasks)."""

    def __init__(
        self,
        control: MigControl,
        store: Store,
        refresh: Callable[[], None],
        faults: FaultLog,
        clock: Callable[[], float],
        keep_s: float | None,
    ) -> None:
        gpus = control.mig_gpus()
        if not gpus:
            raise MigUnavailable(
                "--mig dynamic: no GPU here has MIG mode enabled (an admin enables it: nvidia-smi -i N -mig 1; "
                "carma never changes MIG mode)"
            )
        try:
            self.geometries: dict[TargetId, Geometry] = {g: geometry_of(control, g) for g in gpus}
        except UnknownModel as e:
            raise MigUnavailable(f"--mig dynamic: {e}") from None
        self.control = control
        self.reconfigurations = 0  # carried out to the end since the daemon started
        self.refused = 0  # stopped by a step the GPU refused
        self._store = store
        self._refresh = refresh
        self._faults = faults
        self._clock = clock
        self._keep_s = keep_s

    def start(self) -> list[str]:
        """Before the first decision: finish the reconfiguration a killed daemon left under way, and give a MIG GPU
        with no instance one of its largest profile (it is then a target the placer can split). What was done,
        one line each."""
        done = []
        pending = self._store.meta(JOURNAL)
        if isinstance(pending, dict):
            action = _action(pending)
            geometry = self.geometries.get(action.gpu)
            finished = finish(self.control, action, geometry) if geometry is not None else []
            done += finished
            done.append(f"GPU {action.gpu}: a reconfiguration was under way when the daemon stopped; layout now read")
            what = "; ".join(line.removeprefix(f"GPU {action.gpu}: ") for line in finished) or "nothing left half-made"
            self._end(action, "interrupted", f"under way when the daemon stopped; at its next start: {what}")
        usable = 0  # MIG GPUs with an instance to run tasks on
        for gpu, geometry in self.geometries.items():
            if self.control.gpu_instances(gpu):
                usable += 1
                continue
            whole = geometry.sizing[-1].name
            outcome = self._journaled(
                Reconfigure(gpu, (), (MigSlot(whole, 0),)), "at the daemon's start: the GPU had no MIG instance"
            )
            if outcome == "done":
                usable += 1
                done.append(f"GPU {gpu}: no MIG instance; created {whole}, which carma splits as tasks need")
            else:
                done.append(f"GPU {gpu}: no MIG instance, and {whole} could not be created: no task runs on it")
        self._refresh()
        if not usable:
            raise MigUnavailable(f"--mig dynamic: no MIG GPU has an instance to run tasks on ({'; '.join(done)})")
        return done

    def reconfigure(self, action: Reconfigure) -> None:
        """The `Executor.reconfigure` of the daemon. Not carried out at all when the journal cannot be written."""
        if action.gpu not in self.geometries:
            raise ValueError(f"GPU {action.gpu} is not a MIG GPU carma partitions")
        outcome = self._journaled(action)
        if outcome is None:
            return
        if outcome == "done":
            self.reconfigurations += 1
        else:
            self.refused += 1
        self._refresh()

    def _journaled(self, action: Reconfigure, why: str | None = None) -> str | None:
        """Carry `action` out between its journal entry and its record in the timeline (`why` kept with it when
        done): "done", "refused" (a step the GPU refused; the layout is left consistent), or None when the journal
        cannot be written (nothing is done)."""
        try:
            self._store.set_meta(JOURNAL, _record(action))
        except WORLD_FAULTS as e:
            self._faults.failed(JOURNALING, e)
            return None
        self._faults.cleared(JOURNALING)
        geometry = self.geometries[action.gpu]
        try:
            carry_out(self.control, action, geometry)
        except (MigError, LookupError) as e:
            log.warning("GPU %s: MIG reconfiguration stopped (%s): %s", action.gpu, describe(action), e)
            for line in finish(self.control, action, geometry):
                log.warning("%s", line)
            self._end(action, "refused", str(e))
            return "refused"
        log.info("GPU %s: MIG %s", action.gpu, describe(action))
        self._end(action, "done", why)
        return "done"

    def _end(self, action: Reconfigure, outcome: str, reason: str | None = None) -> None:
        """Keep a journaled reconfiguration and clear the journal, in one write."""
        try:
            self._store.end_reconfiguration(self._entry(action, outcome, reason), self._kept_after(), JOURNAL)
        except WORLD_FAULTS as e:  # left journaled: the next start reads the layout and keeps it as interrupted
            self._faults.failed(JOURNALING, e)

    def _entry(self, action: Reconfigure, outcome: str, reason: str | None) -> Reconfiguration:
        slots = (tuple(map(str, action.destroy)), tuple(map(str, action.create)))
        return Reconfiguration(self._clock(), action.gpu, *slots, outcome, reason)

    def _kept_after(self) -> float | None:
        return None if self._keep_s is None else self._clock() - self._keep_s


def describe(action: Reconfigure) -> str:
    """`destroyed 1g.5gb@0, 1g.5gb@1; created 2g.10gb@0`."""
    parts = []
    if action.destroy:
        parts.append("destroyed " + ", ".join(map(str, action.destroy)))
    if action.create:
        parts.append("created " + ", ".join(map(str, action.create)))
    return "; ".join(parts)


def _record(action: Reconfigure) -> dict[str, object]:
    return {
        "gpu": action.gpu,
        "destroy": [[s.profile, s.start] for s in action.destroy],
        "create": [[s.profile, s.start] for s in action.create],
    }


def _action(record: dict[str, object]) -> Reconfigure:
    def slots(key: str) -> tuple[MigSlot, ...]:
        return tuple(MigSlot(str(p), int(s)) for p, s in record[key])  # type: ignore[attr-defined]

    return Reconfigure(str(record["gpu"]), slots("destroy"), slots("create"))
