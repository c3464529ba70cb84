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
    ("jax/xla", r"RESOURCE_EXHAUSTED:.*(out of memory|while trying to allocate|Failed to allocate)"),
    ("cuda runtime", r"cudaErrorMemoryAllocation"),
    ("cuda driver", r"CUDA_ERROR_OUT_OF_MEMORY"),
    ("cuda", r"CUDA (driver )?error: out of memory"),  # "driver": PyTorch's expandable segments
    ("cublas", r"CUBLAS_STATUS_ALLOC_FAILED"),
    ("cudnn", r"CUDNN_STATUS_ALLOC_FAILED"),
    ("nccl", r"NCCL.*(Failed to CUDA calloc|cudaMalloc.*failed|Cuda failure '?out of memory)"),
)
# Lines that name an out-of-memory error without being the crash: the same message about host memory
# (TensorFlow's CPU allocator: no GPU would help), and a warning (a script that caught the OOM and retried
# with a smaller batch, then failed for another reason, was relaunched exclusively for it): a logger's
# WARNING or a Python warning category, not NCCL's "NCCL WARN", which is how NCCL reports its failures.
NOT_A_GPU_CRASH = r"device:CPU|allocator cpu|(?<!NCCL )\bwarn(ing)?\b|\w+Warning\b"

_OOM_RE = re.compile("|".join(f"(?:{p})" for _, p in OOM_PATTERNS), re.IGNORECASE)
_NOT_A_GPU_CRASH_RE = re.compile(NOT_A_GPU_CRASH, re.IGNORECASE)


def classify_exit(exit: ProcessExit, killed_by_request: bool = False) -> ExitKind:
    if killed_by_request:
        return ExitKind.KILLED
    if exit.exit_code == 0 and exit.signal is None:
        return ExitKind.SUCCESS
    return ExitKind.OOM if oom_message(exit) else ExitKind.ERROR


def oom_message(exit: ProcessExit) -> str:
    """The log line that identified a GPU out-of-memory error, for the task's record ("" if none did)."""
    for line in reversed(exit.log_tail.splitlines()):
        if _OOM_RE.search(line) and not _NOT_A_GPU_CRASH_RE.search(line):
            return line.strip()
    return ""
