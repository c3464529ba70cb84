"""carma's configuration file (TOML): scheduler settings and the twin, with the paper's defaults.

```toml
[scheduler]
policy = "magm"
window_samples = 30
margin_mib = 2048

[scheduler.risk]
enabled = true
smact = 0.80
weights = { mean = 0.2, median = 0.3, p95 = 0.3, ema = 0.2 }

[twin]
gpus = "3xA100-40GB"
sharing = "mps"
fragmentation = 0.05
power_exponent = 0.6
```

Every key is optional; unknown keys are an error, so a typo never passes silently.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from carma.core.config import Policy, RiskConfig, RiskWeights, SchedulerConfig
from carma.sim.experiment import TwinConfig
from carma.sim.gpus import parse_gpus
from carma.sim.models import PowerModel


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Config:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    twin: TwinConfig = field(default_factory=TwinConfig)


def _take(table: dict[str, Any], allowed: set[str], where: str) -> dict[str, Any]:
    unknown = set(table) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    return dict(table)


def _names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


def parse_config(doc: dict[str, Any], source: str = "config") -> Config:
    top = _take(doc, {"scheduler", "twin"}, source)
    sched = _take(top.get("scheduler", {}), _names(SchedulerConfig), f"{source} [scheduler]")
    risk = _take(sched.pop("risk", {}), _names(RiskConfig), f"{source} [scheduler.risk]")
    twin = _take(top.get("twin", {}), {"gpus", "sharing", "fragmentation", "power_exponent"}, f"{source} [twin]")
    try:
        if "weights" in risk:
            weights = _take(risk["weights"], _names(RiskWeights), f"{source} [scheduler.risk.weights]")
            risk["weights"] = RiskWeights(**weights)
        if "policy" in sched:
            sched["policy"] = Policy(sched["policy"])
        scheduler = SchedulerConfig(**sched, risk=RiskConfig(**risk))
        twin_args: dict[str, Any] = {"scheduler": scheduler}
        if "gpus" in twin:
            twin_args["gpus"] = parse_gpus(twin["gpus"])
        if "power_exponent" in twin:
            twin_args["power"] = PowerModel(exponent=float(twin["power_exponent"]))
        for key in ("sharing", "fragmentation"):
            if key in twin:
                twin_args[key] = twin[key]
        return Config(scheduler, TwinConfig(**twin_args))
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{source}: {err}") from None


def load_config(path: Path | None) -> Config:
    if path is None:
        return Config()
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config file {str(path)!r}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML ({err})") from None
    return parse_config(doc, str(path))
