"""Per-GPU monitor windows: the last W samples of each GPU and the statistics decisions read from them."""

from __future__ import annotations

from collections import deque

from carma.core.risk import Risk, RiskWeights, risk_score
from carma.core.types import GpuSample


class MonitorWindow:
    """A sliding window of one GPU's samples; the risk score is computed lazily and cached per window."""

    def __init__(self, size: int, weights: RiskWeights) -> None:
        self._samples: deque[GpuSample] = deque(maxlen=size)
        self._weights = weights
        self._risk: Risk | None = None
        self.latest: GpuSample | None = None  # the newest sample (an attribute: every decision reads it per GPU)

    def add(self, sample: GpuSample) -> None:
        latest = self.latest
        if latest is not None and sample.t <= latest.t:
            return  # a sample we already hold (worlds may re-send the newest one)
        self._samples.append(sample)
        self.latest = sample
        self._risk = None

    def __len__(self) -> int:
        return len(self._samples)

    def risk(self) -> Risk:
        if not self._samples:
            raise ValueError("no samples in the window")
        if self._risk is None:
            self._risk = Risk(*(self._score(metric) for metric in ("smact", "smocc", "drama")))
        return self._risk

    def _score(self, metric: str) -> float | None:
        """The metric's risk over the samples that have it (None when none do)."""
        values = [v for s in self._samples if (v := getattr(s, metric)) is not None]
        return risk_score(values, self._weights) if values else None
