"""What the daemon runs for a task: the command and where, besides the core's placement needs."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from carma.core.types import TaskSpec

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
ARG_STRLEN_MAX = 32 * 4096  # Linux's MAX_ARG_STRLEN: the longest one argument or NAME=value string may be
EXEC_HEADROOM = 16 * 1024  # for the shim's own arguments and the variables the daemon adds to a task's


def exec_size_problem(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """Why Linux would refuse to start this command with this environment (E2BIG), or None. Found at
    submission, not at launch, where it was a failure naming the daemon's interpreter."""
    strings = [*argv, *(f"{k}={v}" for k, v in env.items())]
    sizes = [len(text.encode(errors="surrogatepass")) + 1 for text in strings]
    longest = max(range(len(sizes)), key=sizes.__getitem__)
    if sizes[longest] > ARG_STRLEN_MAX:
        which = "an argument" if longest < len(argv) else "an environment variable"
        return f"{which} is {sizes[longest]} bytes; Linux passes at most {ARG_STRLEN_MAX} bytes each"
    total = sum(sizes) + 8 * len(sizes)  # with a pointer each
    limit = os.sysconf("SC_ARG_MAX") - EXEC_HEADROOM
    if total > limit:
        return f"the command and environment are {total} bytes; a new process here takes at most {limit}"
    return None


def inherited_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of a submitter's environment a task inherits (as sbatch exports it): all but carma's own
    variables (its token among them) and CUDA_VISIBLE_DEVICES, which carma sets; names a shell cannot
    export (e.g. exported bash functions) and values that are not UTF-8 text (`undecodable`) are left out."""
    return {
        k: v
        for k, v in environ.items()
        if ENV_NAME.match(k) and not k.startswith("CARMA_") and k != "CUDA_VISIBLE_DEVICES" and is_text(v)
    }


def is_text(value: str) -> bool:
    """Whether `value` is UTF-8 text: bytes of another encoding (a file name in Latin-1) reach Python as lone
    surrogates, which the server could keep and run but never send back (every listing with it failed)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def undecodable(environ: Mapping[str, str]) -> list[str]:
    """The variables `inherited_env` leaves out for a value that is not UTF-8 text."""
    return sorted(k for k, v in environ.items() if ENV_NAME.match(k) and not is_text(v))


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
    mps_threads: int | None = None  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, when the server runs tasks under MPS
    estimator: str | None = None  # the memory estimator to ask when `mem_mib` is not given (carma.estimate)
    # the run time its submitter expects, not a limit: backfilling and the growth prediction read it before the
    # command's history
    duration_s: float | None = None

    @cached_property
    def size_bytes(self) -> int:
        """What its command, working directory and environment hold, as text: what a user's tasks are capped by."""
        texts = [*self.argv, self.workdir, *self.env.keys(), *self.env.values()]
        return sum(len(text.encode(errors="surrogatepass")) for text in texts)

    def task_spec(self) -> TaskSpec:
        return TaskSpec(self.name, self.gpus, self.mem_mib)
