"""Quantities in messages: memory sizes as users write them ("8GiB", "512MiB", "20GB", "6000"), in MiB, and
counts of things ("1 task", "2 tasks"), and spans of time in hours or minutes; and a job's words cut to fit
a message's line."""

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


MAX_MIB = 2**30  # 1 PiB
UNITS = (
    "Units: KiB, MiB, GiB, TiB or K, M, G, T (powers of 1024: 8G is 8GiB); KB, MB, GB, TB (powers of 1000: 8GB is"
    " 7.45 GiB); B"
)
"""Every unit a memory size takes, for the errors that refuse one: `8G` is GiB, `8GB` is 10^9 bytes."""


def parse_mib(text: str | int | float, *, bare_mib: bool = True) -> int:
    """Parse a memory size into whole MiB (rounded up).

    Binary units (KiB, MiB, GiB, TiB and the short K, M, G, T) are powers of 1024; KB, MB, GB, TB are
    decimal, as on datasheets. A number is MiB; so is a bare number in text where `bare_mib` (a `*_mib`
    column, the API's documented field), and refused where not: `--mem 8` read as 8 MiB without a word.
    """
    if isinstance(text, int | float):
        value, unit = float(text), "m"
    else:
        match = _SIZE_RE.match(text)
        if not match:
            raise ValueError(f"cannot read {text!r} as a memory size, e.g. 8GiB or 512MiB. {UNITS}")
        if not match.group(2) and not bare_mib:
            raise ValueError(f"{text!r} has no unit: write e.g. {text.strip()}GiB. {UNITS}")
        value, unit = float(match.group(1)), (match.group(2).lower() or "m")
    if unit not in _UNITS_BYTES:
        raise ValueError(f"unknown memory unit {unit!r} in {text!r}. {UNITS}")
    if not 0 < value < math.inf:
        raise ValueError(f"memory size must be positive and finite, got {text!r}")
    if (mib := math.ceil(value * _UNITS_BYTES[unit] / 2**20)) > MAX_MIB:  # past float precision, said in noise
        raise ValueError(f"memory size {text!r} is over 1 PiB, more than any GPU holds")
    return mib


_NUMBER, _TIME_UNIT = r"\d+(?:\.\d*)?|\.\d+", r"[dDhHsS]|[mM](?:[iI][nN])?"
_DURATION_PART_RE = re.compile(rf"\s*({_NUMBER})\s*({_TIME_UNIT})\s*")
DURATION_PATTERN = rf"^(?:\s*(?:{_NUMBER})\s*(?:{_TIME_UNIT})\s*)+$"  # a whole run time, as JSON Schema says it
_DURATION_S = {"d": 86400.0, "h": 3600.0, "min": 60.0, "m": 60.0, "s": 1.0}
MAX_DURATION_S = 366 * 86400.0


def parse_seconds(text: str | int | float) -> float:
    """Parse a run time into seconds: `2h`, `90min` (or `90m`), `1h30m`, `45s`, `1d`; a number is seconds."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        seconds = float(text)
    else:
        text = str(text)
        parts = _DURATION_PART_RE.findall(text)
        if not parts or "".join(f"{v}{u}" for v, u in parts) != re.sub(r"\s+", "", text):
            raise ValueError(f"cannot read {text!r} as a run time: write e.g. 2h, 90min, 1h30m or 45s")
        seconds = sum(float(v) * _DURATION_S[u.lower()] for v, u in parts)
    if not 0 < seconds <= MAX_DURATION_S:
        raise ValueError(f"a run time must be above 0 and at most a year, got {text!r}")
    return seconds


def size_text(n: int) -> str:
    """Bytes for people: GiB from 1 GiB up, MiB from 0.1 MiB, KiB below (a small model's parameters read
    "0.0 MiB" when they were a few KiB)."""
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 // 10 or n == 0 else f"{n / 2**10:.1f} KiB"


def cut(line: str, limit: int) -> str:
    """`line`, cut to `limit` characters with an ellipsis: a job's own words in a one-line message (a 65 KB
    exception message was shown whole)."""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def inflect(n: int, one: str, many: str) -> str:
    """The word that agrees with a count of `n`: `one` for 1, else `many` ("has" or "have", "was" or "were")."""
    return one if n == 1 else many


def pluralize(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and the noun in the number it takes: "1 task", "0 tasks", "2 relaunches" (`plural` when not noun + s)."""
    return f"{n} {inflect(n, noun, plural or noun + 's')}"


def time_unit(seconds: float) -> tuple[float, str]:
    """Hours for spans of hours, minutes below two hours (a daemon's short window, or a short trace, stays
    readable instead of "0.01 h"): the seconds in one unit, and its name."""
    return (3600.0, "h") if seconds >= 7200 else (60.0, "min")


def time_format(name: str) -> str:
    """The format spec of a number of hours ("10.40") or minutes ("35.0")."""
    return ".2f" if name == "h" else ".1f"


def in_unit(seconds: float, unit: tuple[float, str]) -> str:
    """Seconds as a number of `unit` (from `time_unit`): "10.40" hours, "35.0" minutes."""
    scale, name = unit
    return f"{seconds / scale:{time_format(name)}}"
