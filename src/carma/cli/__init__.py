"""The `carma` command: one Typer app, its commands in one module per area."""

import sys
from typing import Any

import typer

from carma.cli import (  # noqa: F401  (they register their commands)
    estimate,
    fakejob,
    replay,
    report,
    server,
    service,
    simulate,
    tasks,
    twin,
)
from carma.cli.common import app, error_line, unwrap_help


def main() -> None:
    """Run the app. A mistake the option parser finds (an unknown option, a value of the wrong type) is one
    `error:` line as well, where Click would print the usage, a hint and a framed message."""
    from typer import _click  # Typer 0.28 carries its own Click (pyproject keeps Typer below 0.29)

    command = typer.main.get_command(app)
    unwrap_help(command)
    try:
        sys.exit(command.main(prog_name="carma", standalone_mode=False))
    except _click.exceptions.NoArgsIsHelpError as e:  # `carma`, `carma twin`: the help, as before
        print(e.ctx.get_help())
        sys.exit(e.exit_code)
    except _click.exceptions.UsageError as e:
        where = e.ctx.command_path if e.ctx else _command_path(command, sys.argv[1:])  # `--mem` without a value
        error_line(f"{e.format_message()} (see {where} --help)")
        sys.exit(e.exit_code)
    except _click.exceptions.ClickException as e:  # a file option that cannot be opened, say
        error_line(e.format_message())
        sys.exit(e.exit_code)
    except typer.Abort:  # end of input at a prompt
        sys.exit(1)


def _command_path(command: Any, args: list[str]) -> str:
    """The command the leading words of `args` name (`carma mps start`), for an error Click gives no context."""
    path = ["carma"]
    for word in args:
        command = getattr(command, "commands", {}).get(word)
        if command is None:
            break
        path.append(word)
    return " ".join(path)
