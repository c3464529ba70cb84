"""Memory sizes as users write them ("8GiB", "512MiB", "20GB", "6000"), in MiB."""

from __future__ import annotations

import math
import re

_UNITS_BYTES = {
    "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_mib(text: str | int | float) -> int:
    """Parse a memory size into whole MiB (rounded up); a bare number is already MiB.

    Binary units (KiB, MiB, GiB, TiB and the short K, M, G, T) are powers of 1024; KB, MB, GB, TB are
    decimal, as on datasheets.
    """
    if isinstance(text, int | float):
        value, unit = float(text), "m"
    else:
        match = _SIZE_RE.match(text)
        if not match:
            raise ValueError(f"cannot read {text!r} as a memory size (examples: 8GiB, 512MiB, 6000)")
        value, unit = float(match.group(1)), (match.group(2).lower() or "m")
    if unit not in _UNITS_BYTES:
        raise ValueError(f"unknown memory unit {unit!r} in {text!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB)")
    if not 0 < value < math.inf:
        raise ValueError(f"memory size must be positive and finite, got {text!r}")
    return math.ceil(value * _UNITS_BYTES[unit] / 2**20)
