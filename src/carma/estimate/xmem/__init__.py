"""xMem (Shi, Pezaros, Elkhatib; Middleware '25): a training job's peak GPU memory from a CPU run.

The first iterations run on the CPU under the PyTorch profiler (`carma.estimate.runner`); then
- `analyzer`: memory blocks from the trace's allocation/free events, attributed to operators and to the
  phases of each training iteration, script-level temporaries left out;
- `orchestrator`: their CPU lifetimes mapped to GPU lifetimes (persistent parameters and optimizer
  state, one-iteration batches, gradients freed at `zero_grad`);
- `allocator` and `timeline`: the sequence replayed through a model of PyTorch's CUDA caching allocator
  on a device of fixed capacity; the peak of reserved segments plus the CUDA context is the estimate.
"""

from carma.estimate.xmem.estimator import XMemResult, estimate_xmem, job_tensors, plot_timeline, run_xmem
from carma.estimate.xmem.timeline import Simulation

__all__ = ["Simulation", "XMemResult", "estimate_xmem", "job_tensors", "plot_timeline", "run_xmem"]
