"""`carma systemd-unit`: the packaged unit, with this carma and the server options given."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from support import CARMA, run_carma


def test_the_unit_starts_this_carma_with_the_options_given_and_keeps_tasks_across_restarts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    shown = run_carma("systemd-unit", "--mps", "--tcp", "127.0.0.1:8765")
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert f"ExecStart={CARMA} server --mps --tcp 127.0.0.1:8765" in lines
    assert {"KillMode=process", "LimitNOFILE=65536", "StateDirectory=carma", "NoNewPrivileges=yes"} <= set(lines)
    assert not {"ProtectHome=yes", "PrivateTmp=yes", "PrivateDevices=yes"} & set(lines)  # tasks need them
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed: the unit's syntax is not checked")
    (tmp_path / "carma.service").write_text(shown.stdout)
    verified = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / "carma.service")], capture_output=True, text=True, check=False
    )
    assert verified.returncode == 0 and "carma.service" not in verified.stderr, verified.stderr


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--bogus"], "No such option: --bogus"),
        (["--tcp"], "Option '--tcp' requires an argument"),
        (["--home", "/srv/carma"], "the unit keeps the server's state in /var/lib/carma (its StateDirectory)"),
    ],
)
def test_options_the_server_would_refuse_make_no_unit(options, said) -> None:  # type: ignore[no-untyped-def]
    """They were written into ExecStart, and the unit restarted the refusing server every 5 s for good."""
    shown = run_carma("systemd-unit", *options)
    assert shown.returncode == 2 and shown.stdout == "" and said in shown.stderr
