"""GPU types the twin can model, and the `--gpus 3xA100-40GB` notation."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuType:
    """Memory as nvidia-smi reports it; board power limits from NVIDIA datasheets (docs/twin-model.md)."""

    name: str
    total_mib: int
    idle_w: float
    max_w: float


GPU_TYPES = {
    t.name.lower(): t
    for t in (
        GpuType("A100-40GB", 40960, 50.0, 400.0),
        GpuType("A100-80GB", 81920, 50.0, 400.0),
        GpuType("H100-80GB", 81559, 70.0, 700.0),
        GpuType("H200-141GB", 143771, 75.0, 700.0),
        GpuType("V100-32GB", 32768, 40.0, 300.0),
    )
}

MAX_GPUS = 1024  # one simulated server; each GPU is stepped every tick, so a typo of 10^5 took minutes
_GROUP_RE = re.compile(r"^\s*(?:(\d+)\s*[xX*]\s*)?([\w.-]+)\s*$")


def parse_gpus(text: str) -> tuple[GpuType, ...]:
    """Parse `3xA100-40GB` or a comma list such as `2xA100-40GB,1xH100-80GB`."""
    gpus: list[GpuType] = []
    for group in text.split(","):
        match = _GROUP_RE.match(group)
        if not match:
            raise ValueError(f"cannot read GPU group {group!r}; write e.g. 3xA100-40GB")
        count = int(match.group(1) or 1)
        kind = GPU_TYPES.get(match.group(2).lower())
        if kind is None:
            known = ", ".join(t.name for t in GPU_TYPES.values())
            raise ValueError(f"unknown GPU type {match.group(2)!r} (known: {known})")
        if count < 1:
            raise ValueError(f"GPU count must be at least 1 in {group!r}")
        if len(gpus) + count > MAX_GPUS:
            raise ValueError(f"a simulated server has at most {MAX_GPUS} GPUs; {text!r} asks for more")
        gpus.extend([kind] * count)
    return tuple(gpus)
