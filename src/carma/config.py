"""carma's configuration file (TOML): scheduler settings (with the paper's defaults), the twin, and the
daemon's memory estimates and housekeeping.

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
# power_exponent = 0.9  # unset: the fitted exponent (docs/fidelity.md); set, it overrides it

[estimate]
default = "history"
timeout_s = 600
captures = 1

[server]
keep_ended_days = 0
max_connections = 256
max_user_connections = 32
max_address_connections = 32
idle_timeout_s = 10

[mig]
mode = "static"   # "dynamic": carma creates and destroys MIG instances per task (docs/mig.md)
scheme = "a"
max_passes = 3
min_mib = 4096
predict = true
```

Every key is optional; unknown keys are an error, so a typo never passes silently.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from carma.core.config import SchedulerConfig
from carma.core.mig.scheduling import MigConfig
from carma.core.risk import RiskConfig, RiskWeights
from carma.estimate.registry import METHODS
from carma.sim.experiment import TwinConfig
from carma.sim.gpus import parse_gpus
from carma.sim.models import PowerModel
from carma.textfiles import NotText, read_text

T = TypeVar("T")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class EstimateConfig:
    """The daemon's memory estimates (`carma submit --estimate`): the estimator a task submitted without a
    memory need or an estimator gets (`default`: "history", the peak of its command's earlier successful runs;
    "none": recovery only), how long a capture may take to reach its optimizer steps before the task runs
    recovery only, and how many captures run at once (each holds up to about its job's GPU peak in host
    memory)."""

    default: str = "history"
    timeout_s: float = 600.0
    captures: int = 1

    def __post_init__(self) -> None:
        if self.default not in (*METHODS, "none"):
            raise ValueError(f"default must be none or an estimator ({', '.join(METHODS)}), not {self.default!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, not {self.timeout_s}")
        if self.captures < 1:
            raise ValueError(f"captures must be at least 1, not {self.captures}")


@dataclass(frozen=True)
class ServerConfig:
    """The daemon's housekeeping: how many days (of its clock) an ended task is kept, with its logs and
    history, before it is forgotten (0 keeps every task); and its connections: how many each listener holds
    at once, how many of them one user holds on the unix socket, and how long one may take to send a request."""

    keep_ended_days: float = 0.0
    max_connections: int = 256
    max_user_connections: int = 32
    # behind a reverse proxy every client has the proxy's address: raise it to the proxy's connections
    max_address_connections: int = 32
    idle_timeout_s: float = 10.0
    # tasks not ended (waiting or running) one user may have: each holds its spec (up to ~2 MB of environment)
    # in the daemon's memory and its database
    max_user_tasks: int = 10_000
    # and the commands and environments of those tasks, in MiB (a task's environment may be 2 MB)
    max_user_spec_mib: int = 1024

    def __post_init__(self) -> None:
        if self.keep_ended_days < 0:
            raise ValueError(f"keep_ended_days must be 0 (keep every task) or more, not {self.keep_ended_days}")
        for key in (
            "max_connections",
            "max_user_connections",
            "max_address_connections",
            "max_user_tasks",
            "max_user_spec_mib",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be at least 1, not {getattr(self, key)}")
        if self.idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s must be positive, not {self.idle_timeout_s}")

    @property
    def keep_ended_s(self) -> float | None:
        return self.keep_ended_days * 86400 if self.keep_ended_days else None


@dataclass(frozen=True)
class Config:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    twin: TwinConfig = field(default_factory=TwinConfig)
    estimate: EstimateConfig = field(default_factory=EstimateConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    mig: MigConfig = field(default_factory=MigConfig)
    # the tables the file has: the server reads no [twin] and the twin no [server], [estimate] or [mig], and
    # each says so (of one equal to the defaults too: it was silent on the documented example)
    tables: frozenset[str] = field(default=frozenset(), compare=False)


_TWIN_KEYS = {"gpus": "", "sharing": "", "fragmentation": 0.0, "power_exponent": 0.0}


def _expected(default: object) -> tuple[tuple[type, ...], str]:
    """The types a key takes, judged from its default, and how to name them."""
    if isinstance(default, bool):
        return (bool,), "true or false"
    if isinstance(default, str):
        return (str,), "a string"
    if isinstance(default, float):
        return (int, float), "a number"
    return (int,), "an integer"


def _section(table: object, defaults: dict[str, object], where: str) -> dict[str, Any]:
    """A table's keys, each known and of its default's type; sub-tables are left to the caller."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table, not {table!r}")
    unknown = set(table) - set(defaults)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
    for key, value in table.items():
        if isinstance(defaults[key], dict):
            continue  # a sub-table, checked when it is read
        expected, kind = _expected(defaults[key])
        if not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected):
            raise ConfigError(f"{where}: {key} must be {kind}, not {value!r}")
        if isinstance(value, float) and not math.isfinite(value):  # TOML has inf and nan
            raise ConfigError(f"{where}: {key} must be a finite number, not {value!r}")
    return dict(table)


def _defaults(obj: object) -> dict[str, object]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def _built(where: str, make: Callable[[], T], hint: str = "") -> T:
    """`make()`, its ValueError (a value out of range) named by its file and section, as type errors are."""
    try:
        return make()
    except ValueError as err:
        raise ConfigError(f"{where}: {err}{hint}") from None


def parse_config(doc: dict[str, Any], source: str = "config") -> Config:
    top = _section(doc, {"scheduler": {}, "twin": {}, "estimate": {}, "server": {}, "mig": {}}, source)
    sched_where, risk_where = f"{source} [scheduler]", f"{source} [scheduler.risk]"
    weights_where, twin_where = f"{source} [scheduler.risk.weights]", f"{source} [twin]"
    sched = _section(top.get("scheduler", {}), _defaults(SchedulerConfig()) | {"risk": {}}, sched_where)
    risk = _section(sched.pop("risk", {}), _defaults(RiskConfig()) | {"weights": {}}, risk_where)
    twin = _section(top.get("twin", {}), _TWIN_KEYS, twin_where)
    estimate = _section(top.get("estimate", {}), _defaults(EstimateConfig()), f"{source} [estimate]")
    server = _section(top.get("server", {}), _defaults(ServerConfig()), f"{source} [server]")
    mig = _section(top.get("mig", {}), _defaults(MigConfig()), f"{source} [mig]")
    weights = _section(risk.pop("weights", {}), _defaults(RiskWeights()), weights_where)
    left_out = "; a weight left out keeps its default" if 0 < len(weights) < len(fields(RiskWeights)) else ""
    risk_weights = _built(weights_where, lambda: RiskWeights(**weights), left_out)
    risk_config = _built(risk_where, lambda: RiskConfig(**risk, weights=risk_weights))
    scheduler = _built(sched_where, lambda: SchedulerConfig(**sched, risk=risk_config))
    twin_args: dict[str, Any] = {"scheduler": scheduler}
    if "gpus" in twin:
        twin_args["gpus"] = _built(twin_where, lambda: parse_gpus(twin["gpus"]))
    if "power_exponent" in twin:
        twin_args["power"] = _built(twin_where, lambda: PowerModel(exponent=twin["power_exponent"]))
    for key in ("sharing", "fragmentation"):
        if key in twin:
            twin_args[key] = twin[key]
    return Config(
        scheduler,
        _built(twin_where, lambda: TwinConfig(**twin_args)),
        _built(f"{source} [estimate]", lambda: EstimateConfig(**estimate)),
        _built(f"{source} [server]", lambda: ServerConfig(**server)),
        _built(f"{source} [mig]", lambda: MigConfig(**mig)),
        tables=frozenset(top),
    )


def load_config(path: Path | None) -> Config:
    if path is None:
        return Config()
    try:
        doc = tomllib.loads(read_text(path))
    except FileNotFoundError:
        raise ConfigError(f"no config file {str(path)!r}") from None
    except NotText as err:
        raise ConfigError(str(err)) from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML ({err})") from None
    return parse_config(doc, str(path))
