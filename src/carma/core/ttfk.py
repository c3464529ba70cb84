"""Time-to-first-kernel bookkeeping (CARMA section 2.2).

A freshly dispatched task shows no GPU use until its first batch is ready, so its GPU would look idle and
invite over-collocation. Each GPU therefore records the tasks dispatched to it: the GPU takes no further
tasks until every one of them has been seen on the GPU and one full monitor window has passed since, so
the window reflects the new load. A task that dies releases its GPU at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from carma.core.types import TargetId, TaskId


@dataclass
class _Entry:
    dispatched_s: float
    first_kernel_s: float | None = None
    closes: bool = True  # whether its window keeps the GPU from further tasks (`valid`)


class TtfkTable:
    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._entries: dict[TargetId, dict[TaskId, _Entry]] = {}

    def add(self, gpu: TargetId) -> None:
        self._entries[gpu] = {}

    def remove(self, gpu: TargetId) -> None:
        del self._entries[gpu]

    def dispatched(self, gpu: TargetId, task: TaskId, now: float, closes: bool = True) -> None:
        """Record a task dispatched to `gpu`; one that does not `close` it (its need is known and held, with
        `ttfk_unknown_only`) is tracked for its first kernel but leaves the GPU open to further tasks."""
        entries = self._entries[gpu]
        # the tasks whose windows have passed count no more (time only moves on): a GPU that runs many tasks
        # keeps only those dispatched since it was last valid, and `valid` reads no more
        for old in [
            t for t, e in entries.items() if e.first_kernel_s is not None and now >= e.first_kernel_s + self._window_s
        ]:
            del entries[old]
        entries[task] = _Entry(dispatched_s=now, closes=closes)

    def seen(self, gpu: TargetId, task: TaskId, now: float) -> bool:
        """Record the task's first kernel on `gpu`; True if this is the first sighting."""
        entry = self._entries[gpu].get(task)
        if entry is None or entry.first_kernel_s is not None:
            return False
        entry.first_kernel_s = now
        return True

    def ended(self, task: TaskId) -> None:
        for entries in self._entries.values():
            entries.pop(task, None)

    def awaiting(self, gpu: TargetId) -> bool:
        """Whether a task dispatched to `gpu` has not yet been seen on it (a multi-GPU task seen on another
        of its GPUs included)."""
        return any(entry.first_kernel_s is None for entry in self._entries[gpu].values())

    def warming(self, gpu: TargetId, now: float, within_s: float) -> list[TaskId]:
        """The tasks dispatched to `gpu` not yet seen on it, or seen less than `within_s` ago: a monitor window
        shows little or none of their activity."""
        return [
            task
            for task, e in self._entries[gpu].items()
            if e.first_kernel_s is None or now < e.first_kernel_s + within_s
        ]

    def valid(self, gpu: TargetId, now: float) -> bool:
        """Whether `gpu` may take another task now: every task dispatched to it was seen a window ago."""
        for entry in self._entries[gpu].values():
            if not entry.closes:
                continue
            if entry.first_kernel_s is None or now < entry.first_kernel_s + self._window_s:
                return False
        return True

    def next_expiry(self, now: float) -> float | None:
        """The earliest future moment a GPU becomes valid again by the passing of time alone."""
        times = [
            e.first_kernel_s + self._window_s
            for entries in self._entries.values()
            for e in entries.values()
            if e.first_kernel_s is not None and e.first_kernel_s + self._window_s > now
        ]
        return min(times, default=None)
