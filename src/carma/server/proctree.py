"""The process table as /proc shows it (Linux only): parents, start times, process groups.

The daemon needs three things from it: to tell a live process from a reused pid (pid plus start time,
field 22 of /proc/<pid>/stat, in clock ticks since boot), to attribute a GPU process to the task whose
shim it descends from, and to find what is left of a task's process group. Pids are those of the pid
namespace /proc belongs to; NVML reports host pids, so the daemon must not run in its own pid namespace.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from carma.core.types import TaskId

PROC = "/proc"
_GONE = frozenset({"Z", "X", "x"})  # zombie or dead: the process has ended, only its entry remains


@dataclass(frozen=True)
class Stat:
    """The fields of /proc/<pid>/stat the daemon uses."""

    state: str
    ppid: int
    pgid: int
    start_ticks: int

    @property
    def running(self) -> bool:
        return self.state not in _GONE


def parse_stat(text: str) -> Stat:
    """Parse a stat line. The command name (field 2) may hold spaces and parentheses, so it is cut at the
    last ')' rather than split on whitespace."""
    fields = text[text.rindex(")") + 2 :].split()  # fields[0] is field 3 (state)
    return Stat(state=fields[0], ppid=int(fields[1]), pgid=int(fields[2]), start_ticks=int(fields[19]))


def read_stat(pid: int) -> Stat | None:
    """The process's stat, or None when there is no such process (or it vanished while being read)."""
    try:
        with open(f"{PROC}/{pid}/stat") as f:
            return parse_stat(f.read())
    except (OSError, ValueError, IndexError):
        return None


def start_ticks(pid: int) -> int | None:
    stat = read_stat(pid)
    return stat.start_ticks if stat is not None else None


def alive(pid: int, start_ticks: int | None) -> bool:
    """Whether `pid` is still the process that started at `start_ticks` and has not ended (a zombie has)."""
    stat = read_stat(pid)
    return stat is not None and stat.running and stat.start_ticks == start_ticks


def cmdline(pid: int) -> tuple[str, ...]:
    """The process's argv, empty when it is gone or unreadable."""
    try:
        with open(f"{PROC}/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return ()
    return tuple(arg.decode(errors="replace") for arg in raw.split(b"\0")[:-1])


def snapshot() -> dict[int, Stat]:
    """One pass over /proc: the stat of every process that exists now."""
    stats = {}
    for name in os.listdir(PROC):
        if name.isdigit():
            stat = read_stat(int(name))
            if stat is not None:
                stats[int(name)] = stat
    return stats


def owners(pids: Iterable[int], roots: Mapping[int, TaskId]) -> dict[int, TaskId]:
    """Map each pid to the task whose root (shim) it descends from, reading the stat of the processes on the
    pids' chains of parents only, each once: every scheduling step asks, and a server runs thousands of
    processes beside the few on its GPUs.

    A pid that is itself a root maps to that root's task; pids under no root are left out.
    """
    parents: dict[int, int | None] = {}

    def parent(pid: int) -> int | None:
        if pid not in parents:
            stat = read_stat(pid)
            parents[pid] = stat.ppid if stat is not None else None
        return parents[pid]

    found: dict[int, TaskId | None] = {}  # memo for every pid on a walked chain
    result = {}
    for pid in pids:
        chain = []
        current: int | None = pid
        while current is not None and current not in found and current not in roots:
            chain.append(current)
            current = parent(current)
            if current in chain:  # a cycle can only come from entries read at different moments
                current = None
        owner = None if current is None else roots.get(current, found.get(current))
        for member in chain:
            found[member] = owner
        if owner is not None:
            result[pid] = owner
    return result


def group_members(pgid: int) -> set[int]:
    """Live processes in process group `pgid` (zombies excluded: they hold nothing)."""
    return {pid for pid, stat in snapshot().items() if stat.pgid == pgid and stat.running}
