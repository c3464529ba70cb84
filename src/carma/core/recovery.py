"""Recovery classification: was a failed task killed by GPU memory exhaustion?

CARMA recovers OOM-crashed tasks by relaunching them on a whole idle GPU, so the scheduler must tell an
out-of-memory failure from any other error. It reads the exit status and the tail of the task's error
log; these patterns are the messages the common frameworks and CUDA libraries print when an allocation
fails. Matching is case-insensitive.
"""

from __future__ import annotations

import re

from carma.core.types import ExitKind, ProcessExit

OOM_PATTERNS: tuple[tuple[str, str], ...] = (
    ("pytorch", r"CUDA out of memory"),
    ("pytorch", r"torch\.(cuda\.)?OutOfMemoryError"),
    ("tensorflow", r"ResourceExhaustedError"),
    ("tensorflow", r"OOM when allocating tensor"),
    ("jax/xla", r"RESOURCE_EXHAUSTED:.*(out of memory|while trying to allocate)"),
    ("cuda runtime", r"cudaErrorMemoryAllocation"),
    ("cuda driver", r"CUDA_ERROR_OUT_OF_MEMORY"),
    ("cuda", r"CUDA error: out of memory"),
    ("cublas", r"CUBLAS_STATUS_ALLOC_FAILED"),
    ("cudnn", r"CUDNN_STATUS_ALLOC_FAILED"),
    ("nccl", r"NCCL.*(Failed to CUDA calloc|cudaMalloc.*failed)"),
)

_OOM_RE = re.compile("|".join(f"(?:{p})" for _, p in OOM_PATTERNS), re.IGNORECASE)


def classify_exit(exit: ProcessExit, killed_by_request: bool = False) -> ExitKind:
    if killed_by_request:
        return ExitKind.KILLED
    if exit.exit_code == 0 and exit.signal is None:
        return ExitKind.SUCCESS
    if _OOM_RE.search(exit.log_tail):
        return ExitKind.OOM
    return ExitKind.ERROR


def oom_message(exit: ProcessExit) -> str:
    """The log line that identified the OOM, for the task's record."""
    for line in reversed(exit.log_tail.splitlines()):
        if _OOM_RE.search(line):
            return line.strip()
    return ""
