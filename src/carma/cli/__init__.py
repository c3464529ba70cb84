"""The `carma` command: one Typer app, its commands in one module per area."""

from carma.cli import estimate, replay, report, server, simulate, tasks, twin  # noqa: F401  (they register their commands)
from carma.cli.common import app


def main() -> None:
    app()
