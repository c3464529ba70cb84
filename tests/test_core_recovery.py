"""Telling out-of-memory crashes from other failures, from exit status and error-log tail."""

import pytest

from carma.core import ExitKind, ProcessExit
from carma.core.recovery import OOM_PATTERNS, classify_exit, oom_message

OOM_LOGS = [
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 39.39 GiB",
    "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 39.59 GiB total capacity)",
    "torch.cuda.OutOfMemoryError: CUDA out of memory.",
    "tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating tensor with shape[64,3]",
    "jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB.",
    "RuntimeError: CUDA error: out of memory",
    "cudaErrorMemoryAllocation: out of memory",
    "CUDA_ERROR_OUT_OF_MEMORY: out of memory",
    "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
    "NCCL WARN Failed to CUDA calloc 1048576 bytes",
    # these three were errors, not recovered
    "RuntimeError: CUDA driver error: out of memory",  # PyTorch with expandable segments
    "XlaRuntimeError: RESOURCE_EXHAUSTED: Failed to allocate request for 2.00GiB (2147483648B) on device ordinal 0",
    "gpu1:2:2 [1] NCCL WARN Cuda failure 'out of memory'",
]


@pytest.mark.parametrize("line", OOM_LOGS)
def test_framework_and_cuda_oom_messages_are_recognised(line):
    exit = ProcessExit(1, f"Traceback (most recent call last):\n  File 'train.py'\n{line}\n")
    assert classify_exit(exit) is ExitKind.OOM
    assert oom_message(exit) == line


def test_every_pattern_is_exercised():
    import re

    for framework, pattern in OOM_PATTERNS:
        assert any(re.search(pattern, line, re.IGNORECASE) for line in OOM_LOGS), framework


@pytest.mark.parametrize(
    "log",
    [
        "ValueError: learning rate must be positive",
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        "MemoryError",  # host memory, not the GPU: relaunching on an idle GPU would not help
        "tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating tensor with "
        "shape[1024,1024,1024] and type float on /job:localhost/replica:0/task:0/device:CPU:0 by allocator cpu",
        # an OOM the script caught and logged, then another failure: it was relaunched exclusively for the OOM
        "WARNING:train:torch.OutOfMemoryError: CUDA out of memory at batch 64; retrying with batch 32\n"
        "ValueError: bad label in data.csv",
        "train.py:40: UserWarning: CUDA out of memory, emptying the cache and retrying\nKeyError: 'label'",
        "",
    ],
)
def test_other_failures_are_errors(log):
    assert classify_exit(ProcessExit(1, log)) is ExitKind.ERROR


def test_success_and_kills():
    assert classify_exit(ProcessExit(0, "CUDA out of memory (recovered by the script itself)")) is ExitKind.SUCCESS
    assert classify_exit(ProcessExit(None, "", signal=9)) is ExitKind.ERROR
    assert classify_exit(ProcessExit(None, "", signal=15), killed_by_request=True) is ExitKind.KILLED
