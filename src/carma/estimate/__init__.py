"""Estimating a training job's peak GPU memory before it runs, on the CPU.

One interface (`Estimate` with a `Breakdown`) over several methods: xMem (profile the first iterations on
the CPU and replay them through a model of PyTorch's CUDA caching allocator), and the baselines CARMA
used (Horus, FakeTensor, GPUMemNet), plus the observed peak of an earlier run (history). PyTorch is an
optional extra: `pip install 'carma-gpu[estimate]'`.
"""

from carma.estimate.base import Breakdown, Estimate, EstimateError, TrainingJob

__all__ = ["Breakdown", "Estimate", "EstimateError", "TrainingJob"]
