"""`carma fakejob`: a stand-in training job for fake GPUs, run by the `carma` on the PATH (a task submitted as
`python -m carma.fakejob` failed with `No module named 'carma'` when the PATH's python was another one)."""

from __future__ import annotations

import typer

from carma.cli.common import app

# Every word after `fakejob`, --help included, is the job's: its options are carma.fakejob's argparse ones
_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


@app.command("fakejob", context_settings=_PASS_THROUGH, add_help_option=False)
def fakejob_cmd(ctx: typer.Context) -> None:
    """A fake training job for `carma server --fake-gpus` (carma fakejob --help: its options).

    `carma submit --mem 8GiB -- carma fakejob --mem 8GiB --seconds 600`: it allocates its memory on its fake
    GPUs and computes at the speed its co-runners leave it."""
    from carma.fakejob import main

    raise typer.Exit(main(ctx.args, prog="carma fakejob"))
