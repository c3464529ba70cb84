"""matplotlib, an optional extra, for every chart carma draws (run charts, xMem's memory timeline).

Its own module, below the reports and the estimators alike, so that neither reaches into the other for it.
"""

from __future__ import annotations

from typing import Any


class PlotsUnavailable(RuntimeError):
    pass


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend; without matplotlib, PlotsUnavailable saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotsUnavailable("plots need matplotlib: pip install 'carma-gpu[plot]'") from None
    return plt
