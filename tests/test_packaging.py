"""The distribution as a user gets it: a wheel and an sdist built from a clean clone of the checkout (what is
committed, nothing else), checked by twine, the wheel installed into a fresh virtual environment with its
dependencies from the package index (as `pip install carma-gpu` gets them) and run there: the twin, and the
server on a fake GPU with a fake job."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import carma
from support import cli_env, wait_until

ROOT = Path(__file__).parents[1]

pytestmark = pytest.mark.slow  # about 40 s, most of it pip resolving the dependencies


def _run(*args: object, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(map(str, args)), capture_output=True, text=True, env=env, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel and sdist of a clean clone, built without build isolation (this environment's setuptools)."""
    pytest.importorskip("build", reason="building needs `build` (the dev extra: pip install -e '.[dev]')")
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no clean clone to build from")
    where = tmp_path_factory.mktemp("dist")
    clone = where / "clone"
    # safe.directory: the checkout may belong to another user than the one running the tests (root on CI)
    cloned = _run("git", "-c", "safe.directory=*", "clone", "--quiet", "--no-hardlinks", ROOT, clone)
    assert cloned.returncode == 0, cloned.stderr
    built = _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", where / "out", clone)
    assert built.returncode == 0, built.stdout + built.stderr
    return where / "out"


def test_the_wheel_and_sdist_carry_the_distribution_name_and_version_and_pass_twine(dist: Path) -> None:
    pytest.importorskip("twine", reason="checking needs `twine` (the dev extra)")
    files = sorted(p.name for p in dist.iterdir())
    version = carma.__version__
    assert files == [f"carma_gpu-{version}-py3-none-any.whl", f"carma_gpu-{version}.tar.gz"]
    checked = _run(sys.executable, "-m", "twine", "check", "--strict", *sorted(dist.iterdir()))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_wheel_installs_into_a_fresh_venv_and_runs_the_twin_and_the_server(dist: Path) -> None:
    venv = Path(tempfile.mkdtemp(prefix="carma-venv-"))
    home = Path(tempfile.mkdtemp(prefix="c", dir="/tmp"))  # the server's socket path must stay short
    server: subprocess.Popen[bytes] | None = None
    try:
        assert _run(sys.executable, "-m", "venv", venv).returncode == 0
        (wheel,) = dist.glob("*.whl")
        installed = _run(venv / "bin/python", "-m", "pip", "install", "--quiet", wheel, timeout=600)
        assert installed.returncode == 0, installed.stderr
        path = os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", os.defpath)])
        env = {k: v for k, v in cli_env(CARMA_HOME=str(home), PATH=path).items() if k != "PYTHONPATH"}
        where = _run(venv / "bin/python", "-c", "import carma; print(carma.__file__)", env=env)
        assert where.stdout.startswith(str(venv)), where.stdout  # the wheel's carma, not the checkout's
        carma_cmd = venv / "bin/carma"
        assert _run(carma_cmd, "--version", env=env).stdout == f"carma {carma.__version__}\n"

        simulated = _run(carma_cmd, "simulate", "--trace", "carma-t1", "--policy", "magm", env=env)
        assert simulated.returncode == 0, simulated.stderr
        assert "trace carma-t1: 60 tasks on 3xA100-40GB (MPS), MAGM recovery only" in simulated.stdout

        log = open(home / "server.log", "wb")  # noqa: SIM115 (the daemon's for its lifetime)
        server = subprocess.Popen([carma_cmd, "server", "--fake-gpus", "1xA100-40GB", "--time-scale", "100"],
                                  env=env, stdout=log, stderr=log)  # fmt: skip
        wait_until(lambda: _run(carma_cmd, "status", env=env).returncode == 0, 30, "the server to answer")
        assert _run(carma_cmd, "status", env=env).stdout.startswith(f"carma {carma.__version__}: 1 GPU")
        job = ["carma", "fakejob", "--mem", "1GiB", "--seconds", "100", "--ttfk", "1", "--warmup", "1"]
        submitted = _run(carma_cmd, "submit", "--mem", "1GiB", "--", *job, env=env)
        assert submitted.returncode == 0, submitted.stderr
        waited = _run(carma_cmd, "wait", "1", "--timeout", "60", env=env)
        assert waited.stdout == "task 1 completed\n", (waited.stdout, _run(carma_cmd, "logs", "1", "--stderr", env=env))
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=30)
        shutil.rmtree(venv, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
