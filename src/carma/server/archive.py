"""The GPUs' recent past, for the dashboard's charts and `carma report`: samples condensed into buckets of
`bucket_s` scheduler seconds and archived in the store (ten-second buckets of 8 GPUs are about 70,000 rows
a day; rows older than `keep_s` are dropped).

Per bucket: the most memory used (peaks are what memory planning cares about), the mean SMACT, SMOCC,
DRAMA and power of the samples that had them (None when none did: missing stays missing), the last
energy counter and total, the highest temperature.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from carma.core.types import GpuSample, TargetId, TaskId
from carma.server.store import Store
from carma.telemetry import DeviceReading

BUCKET_S = 10.0
KEEP_S = 30 * 86400.0
MEANS = ("smact", "smocc", "drama", "power_w")


@dataclass
class _Bucket:
    start: float
    used_mib: int = 0
    total_mib: int = 0
    energy_j: float | None = None
    temperature_c: float | None = None
    sums: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in MEANS})

    def add(self, s: GpuSample) -> None:
        self.used_mib = max(self.used_mib, s.used_mib)
        self.total_mib = s.total_mib
        self.energy_j = s.energy_j if s.energy_j is not None else self.energy_j
        if s.temperature_c is not None:
            self.temperature_c = max(self.temperature_c or s.temperature_c, s.temperature_c)
        for m in MEANS:
            value = getattr(s, m)
            if value is not None:
                self.sums[m].append(value)

    def values(self) -> dict[str, float | None]:
        means = {m: (sum(v) / len(v) if v else None) for m, v in self.sums.items()}
        return {
            "used_mib": self.used_mib,
            "total_mib": self.total_mib,
            **means,
            "energy_j": self.energy_j,
            "temperature_c": self.temperature_c,
        }


class SampleArchive:
    def __init__(self, store: Store, bucket_s: float = BUCKET_S, keep_s: float = KEEP_S) -> None:
        self._store = store
        self.bucket_s = bucket_s
        self._keep_s = keep_s
        self._open: dict[TargetId, _Bucket] = {}

    def observe(self, readings: Sequence[DeviceReading], owner_of: Mapping[int, TaskId] | None = None) -> None:
        """Add one reading per GPU; buckets that are over are written, all in one transaction."""
        done: list[tuple[TargetId, float, dict[str, float | None]]] = []
        for r in readings:
            s = r.sample
            start = math.floor(s.t / self.bucket_s) * self.bucket_s
            bucket = self._open.get(s.gpu)
            if bucket is not None and bucket.start != start:
                done.append((s.gpu, bucket.start, bucket.values()))
                bucket = None
            if bucket is None:
                bucket = self._open[s.gpu] = _Bucket(start)
            bucket.add(s)
        if done:
            self._store.add_gpu_samples(done, keep_after_s=max(t for _, t, _ in done) - self._keep_s)
