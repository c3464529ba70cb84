"""Placement policies, registered by name: `[scheduler] policy` and `--policy` choose among these.

A new policy is a module here with a class that follows `Policy` (deriving from `BasePolicy`), named in
`_REGISTERED` below.
"""

from __future__ import annotations

from collections.abc import Callable

from carma.core.policies.base import BasePolicy, Policy
from carma.core.policies.bf import BestFit
from carma.core.policies.exclusive import Exclusive
from carma.core.policies.ff import FirstFit
from carma.core.policies.lug import LeastUtilized
from carma.core.policies.magm import MostAvailableMemory
from carma.core.policies.pair import InterferenceAware
from carma.core.policies.rr import RoundRobin

PolicyFactory = Callable[[], Policy]

_REGISTERED: tuple[type[BasePolicy], ...] = (
    Exclusive,
    RoundRobin,
    MostAvailableMemory,
    LeastUtilized,
    FirstFit,
    BestFit,
    InterferenceAware,
)  # in the order their names are listed to users
POLICIES: dict[str, PolicyFactory] = {p.name: p for p in _REGISTERED}
POLICY_NAMES: tuple[str, ...] = tuple(POLICIES)


__all__ = ["POLICIES", "POLICY_NAMES", "BasePolicy", "Policy", "PolicyFactory"]
