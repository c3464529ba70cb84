"""The daemon's adapters of the core's ports: telemetry over a GPU backend (GPU processes resolved to tasks
through the process tree), the journal over the store, and the run recorder that keeps what telemetry saw
of each live task. The daemon wires them (`carma.server.daemon`); the core sees only the ports.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from carma.core.loop import JournalError
from carma.core.ports import GpuProcesses, TelemetryReading
from carma.core.types import Target, TargetId, Task, TaskId
from carma.server import proctree
from carma.server.faults import WORLD_FAULTS
from carma.server.store import OBSERVED, Observation, Store
from carma.telemetry import DeviceReading, GpuBackend


class RunRecorder:
    """Per live task: the most GPU memory its processes held on one GPU, and the metrics it ran under
    (running sums: a task of weeks costs no more than one of minutes).

    Seen from telemetry once the task shows on its GPUs. What was seen so far is saved now and then and
    when the daemon stops (`live`), and taken up again after a restart (`resume`).
    """

    def __init__(self) -> None:
        self._peak: dict[TaskId, int] = {}
        self._sums: dict[TaskId, dict[str, list[float]]] = {}  # metric -> [sum, samples with a value]

    def observe(self, readings: Sequence[DeviceReading], owner_of: Mapping[int, TaskId]) -> None:
        used: dict[TaskId, dict[TargetId, int]] = {}
        for r in readings:
            for p in r.processes:
                if p.pid in owner_of:
                    per_gpu = used.setdefault(owner_of[p.pid], {})
                    per_gpu[r.sample.gpu] = per_gpu.get(r.sample.gpu, 0) + p.used_mib
        samples = {r.sample.gpu: r.sample for r in readings}
        for task_id, per_gpu in used.items():
            self._peak[task_id] = max(self._peak.get(task_id, 0), *per_gpu.values())
            sums = self._sums.setdefault(task_id, {m: [0.0, 0] for m in OBSERVED})
            for gpu in per_gpu:
                for metric in OBSERVED:
                    value = getattr(samples[gpu], metric)
                    if value is not None:
                        sums[metric][0] += value
                        sums[metric][1] += 1

    def resume(self, task_id: TaskId, seen: Observation) -> None:
        """Go on from what an earlier daemon saw of the task's live attempt."""
        self._peak[task_id] = seen.peak_mib
        means = {m: getattr(seen, f"{m}_mean") for m in OBSERVED}
        self._sums[task_id] = {m: [0.0, 0] if v is None else [v * seen.samples, seen.samples] for m, v in means.items()}

    def peaks(self) -> dict[TaskId, int]:
        """Each live task's peak memory so far (MiB), without the means `live` works out."""
        return dict(self._peak)

    def live(self) -> dict[TaskId, Observation]:
        """What has been seen so far of each live task."""
        return {task_id: self._seen(task_id) for task_id in self._peak}

    def finish(self, task_id: TaskId) -> Observation | None:
        """What was seen of the task's attempt that just ended (None if it never showed on a GPU)."""
        if task_id not in self._peak:
            return None
        seen = self._seen(task_id)
        del self._peak[task_id], self._sums[task_id]
        return seen

    def _seen(self, task_id: TaskId) -> Observation:
        sums = self._sums[task_id]
        means = {f"{m}_mean": total / n if n else None for m, (total, n) in sums.items()}
        return Observation(self._peak[task_id], **means, samples=max(int(n) for _, n in sums.values()))


class Journal:
    """The core's Journal port: the store, plus each ended attempt's observation (in the same transaction,
    and kept until it is written: a save that failed is retried with it)."""

    def __init__(
        self, store: Store, recorder: RunRecorder, ended: Callable[[Sequence[TaskId]], None] = lambda ids: None
    ) -> None:
        """`ended`: told the tasks saved as ended (completed, failed or cancelled), once they are."""
        self._store = store
        self._recorder = recorder
        self._told = ended
        self._ended: dict[tuple[TaskId, int], Observation] = {}
        self.fault: BaseException | None = None  # why the last save failed

    def save(self, tasks: Sequence[Task]) -> None:
        for task in tasks:
            attempt = task.current
            if attempt is not None and attempt.ended_s is not None:
                seen = self._recorder.finish(task.id)
                if seen is not None:
                    self._ended[task.id, attempt.number] = seen
        try:
            self._store.save(tasks, self._ended)
        except WORLD_FAULTS as e:  # a full disk: the loop keeps the changes and saves them again later
            self.fault = e
            raise JournalError(str(e)) from e
        self._ended.clear()
        self._told([task.id for task in tasks if task.terminal])


Observer = Callable[[Sequence[DeviceReading], Mapping[int, TaskId]], None]


class BackendTelemetry:
    """The core's Telemetry port over a GPU backend: GPU pids resolved to tasks through the process tree.
    Each reading is also shown to the observers (the run recorder, the sample archive)."""

    def __init__(
        self, backend: GpuBackend, owners: Callable[[], Mapping[int, TaskId]], observers: Sequence[Observer]
    ) -> None:
        self._backend = backend
        self._owners = owners
        self._observers = observers

    def gpus(self) -> list[Target]:
        return list(self._backend.gpus())

    def read(self, now: float) -> TelemetryReading:
        readings = self._backend.read(now)
        owner_of = proctree.owners([p.pid for r in readings for p in r.processes], self._owners())
        for observe in self._observers:
            observe(readings, owner_of)
        processes = {}
        for r in readings:
            used: dict[TaskId, int] = {}
            for p in r.processes:
                if p.pid in owner_of:
                    used[owner_of[p.pid]] = used.get(owner_of[p.pid], 0) + p.used_mib
            foreign = sum(1 for p in r.processes if p.pid not in owner_of)
            processes[r.sample.gpu] = GpuProcesses(frozenset(used), foreign, used)
        return TelemetryReading([r.sample for r in readings], processes)
