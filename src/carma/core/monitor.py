"""Per-GPU monitor windows: the last W samples of each GPU and the statistics decisions read from them."""

from __future__ import annotations

from collections import deque
from typing import cast

from carma.core.risk import METRICS, Risk, RiskWeights, risk_score
from carma.core.types import GpuSample


class MonitorWindow:
    """A sliding window of one GPU's samples; the risk score is computed lazily and cached per window.

    Each metric's values are kept in a column of their own as the samples come (a decision reads every GPU's
    risk at every step, and each sample changes it), with a count of the samples in the window without it."""

    def __init__(self, size: int, weights: RiskWeights) -> None:
        self._columns: dict[str, deque[float | None]] = {metric: deque(maxlen=size) for metric in METRICS}
        self._missing = dict.fromkeys(METRICS, 0)  # per metric: the samples in the window without a value
        self._size = size
        self._weights = weights
        self._risk: Risk | None = None
        self.latest: GpuSample | None = None  # the newest sample (an attribute: every decision reads it per GPU)

    def add(self, sample: GpuSample) -> None:
        latest = self.latest
        if latest is not None and sample.t <= latest.t:
            return  # a sample we already hold (worlds may re-send the newest one)
        for metric, column in self._columns.items():
            if len(column) == self._size and column[0] is None:
                self._missing[metric] -= 1  # it leaves the window
            value = getattr(sample, metric)
            column.append(value)
            if value is None:
                self._missing[metric] += 1
        self.latest = sample
        self._risk = None

    def __len__(self) -> int:
        return len(self._columns["smact"])

    def risk(self) -> Risk:
        if self.latest is None:
            raise ValueError("no samples in the window")
        if self._risk is None:
            self._risk = Risk(*(self._score(metric) for metric in METRICS))
        return self._risk

    def _score(self, metric: str) -> float | None:
        """The metric's risk over the samples that have it (None when none do)."""
        column = self._columns[metric]
        missing = self._missing[metric]
        values = [v for v in column if v is not None] if missing else cast("list[float]", list(column))
        return risk_score(values, self._weights) if values else None
