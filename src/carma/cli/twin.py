"""`carma twin`: calibrating the digital twin and reporting its fidelity."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from carma.cli.common import PATH_VALUE, UsageError, app, check_writable, err, fail, naming, out

twin_app = typer.Typer(help="Calibrate the digital twin on measurements and report its fidelity.", no_args_is_help=True)
app.add_typer(twin_app, name="twin")
DataOption = Annotated[
    Path | None,
    typer.Option(
        "--data", help="Public datasets folder (lucid/, gpumemnet/); found beside the checkout.", **PATH_VALUE
    ),
]


@twin_app.command("calibrate")
def twin_calibrate(data: DataOption = None) -> None:
    """Fit the twin's models and profiles on the measurements and write the files carma ships."""
    try:
        from carma.calibration.calibrate import calibrate, shipped_paths, write
        from carma.calibration.sources import find_datasets

        calibration = calibrate(find_datasets(data))
        paths = shipped_paths()
        write(calibration, *paths)
    except (OSError, ImportError, ValueError) as e:
        raise fail(e) from None
    a, p, q = calibration.timeslice
    out.print(
        f"time-slicing: a={a:.3f} p={p:.2f} q={q:.2f}; MPS share {calibration.mps_share:.3f}; "
        f"power exponent {calibration.power_exponent:.3f}; {len(calibration.profiles)} task profiles"
    )
    for path in paths:
        out.print(f"wrote {path}")


@twin_app.command("validate")
def twin_validate(
    data: DataOption = None,
    report: Annotated[
        Path | None,
        typer.Option(
            help="Where to write the fidelity report. \\[default: the checkout's docs/fidelity.md, else ./fidelity.md]",
            show_default=False,
            **PATH_VALUE,
        ),
    ] = None,
    jobs: Annotated[int, typer.Option(help="Processes for the trace-1 sweep.", min=1)] = 1,
) -> None:
    """Cross-validate the models, check them against the thesis, run trace 1, and write the fidelity report."""
    report = report or _checkout_report()
    try:
        check_writable("--report", report)  # said before the minutes of work, not after
        from carma.calibration.calibrate import calibrate
        from carma.calibration.fidelity import evaluate, findings, write_report
        from carma.calibration.sources import find_datasets

        root = find_datasets(data)
        fidelity = evaluate(calibrate(root), root, jobs)
        with naming("--report", report):  # a file that takes no writes (/proc's) said only "Input/output error"
            written = write_report(fidelity, report, "carma twin validate")
    except (OSError, ImportError, ValueError, UsageError) as e:
        raise fail(e) from None
    v = fidelity.validation
    out.print(
        f"interference: held-out MAE {v.model_mae:.4f} (baselines: "
        + ", ".join(f"{name} {mae:.4f}" for name, mae in v.baseline_mae.items())
        + ")"
    )
    for finding in findings(fidelity):
        out.print(f"{'yes' if finding.holds else 'NO '}  {finding.claim}: {finding.detail}")
    if not fidelity.shipped_matches_fit:
        err.print("the shipped parameters differ from this fit: run `carma twin calibrate`")
    out.print(f"wrote {report}" if written else f"{report}: the same figures, left as it was (its date kept)")


def _checkout_report() -> Path:
    """The report the checkout carma runs from ships (docs/fidelity.md beside src/), else ./fidelity.md: run
    anywhere else, the default wrote a docs/ folder into whatever directory it was run from."""
    import carma

    shipped = Path(carma.__file__).resolve().parents[2] / "docs" / "fidelity.md"
    return shipped if shipped.is_file() else Path("fidelity.md")
