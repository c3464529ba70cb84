"""`carma systemd-unit`: the daemon's hardened systemd unit, ready to install."""

from __future__ import annotations

import shlex
import shutil
import sys
from importlib.resources import files
from pathlib import Path

import typer

from carma.cli.common import app, fail


@app.command(
    "systemd-unit",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def systemd_unit_cmd(ctx: typer.Context) -> None:
    """Print carma's systemd unit, its ExecStart this carma with the `carma server` options that follow, e.g.
    `carma systemd-unit --mps --tcp 127.0.0.1:8765 > /etc/systemd/system/carma.service`."""
    options = list(ctx.args)
    _check_server_options(options)
    carma = Path(sys.argv[0]).resolve() if Path(sys.argv[0]).name == "carma" else shutil.which("carma")
    if carma is None:
        raise fail("cannot find the installed `carma` command to start")
    template = files("carma.server").joinpath("systemd/carma.service").read_text()
    unit = template.replace("@CARMA@", shlex.quote(str(carma))).replace(
        "@OPTIONS@", "".join(f" {shlex.quote(o)}" for o in options)
    )
    sys.stdout.write(unit)


def _check_server_options(options: list[str]) -> None:
    """Refuse options `carma server` would refuse at its start, which the unit would then retry every 5 s for
    good; and `--home`, as the unit keeps the state in /var/lib/carma (its StateDirectory)."""
    import click

    if any(o == "--home" or o.startswith("--home=") for o in options):
        raise fail("the unit keeps the server's state in /var/lib/carma (its StateDirectory): drop --home")
    server = typer.main.get_command(app).commands["server"]  # type: ignore[attr-defined]
    try:
        server.make_context("carma server", list(options))
    except click.ClickException as e:
        raise fail(f"carma server {shlex.join(options)}: {e.format_message()}") from None
