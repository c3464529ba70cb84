"""What the benchmark scripts share: option types whose bad values are argparse's one-line usage error (they
were tracebacks: `--sample 0` a StatisticsError), and the machine line every report begins with."""

from __future__ import annotations

import argparse
import math
import os
import platform


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text}")
    return value


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of positive whole numbers (`10,40,120`)."""
    return [positive_int(part.strip()) for part in text.split(",")]


def machine_line(*more: str) -> str:
    """The machine, and its load when the benchmark began: timings taken beside other work are slower, and
    the load is what tells a reader so."""
    cpu = platform.processor() or platform.machine()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    parts = [cpu, f"{os.cpu_count()} CPUs", f"load {load} (1, 5, 15 min)", f"Python {platform.python_version()}"]
    return "machine: " + ", ".join([*parts, *more])
