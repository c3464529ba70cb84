"""What the daemon runs for a task: the command and where, besides the core's placement needs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from carma.core.types import TaskSpec


@dataclass(frozen=True)
class JobSpec:
    """A submitted job: argv (no shell unless `shell`), working directory, environment, owner."""

    name: str
    argv: tuple[str, ...]
    workdir: str
    gpus: int = 1
    mem_mib: int | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    shell: bool = False
    uid: int = 0
    gid: int = 0
    user: str = ""

    def task_spec(self) -> TaskSpec:
        return TaskSpec(self.name, self.gpus, self.mem_mib)
