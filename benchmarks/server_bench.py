"""The daemon's performance targets on fake GPUs (issue "the carma server").

- submitting 1,000 tasks through the API: at least 200 submissions/s sustained;
- `carma queue` with 1,000 queued tasks: under 300 ms (the whole CLI command, process start included);
- one scheduling decision with 8 GPUs and 1,000 queued tasks: under 1 ms at the median;
- the idle daemon with 8 fake GPUs sampled at 1 Hz: under 2% of one core, resident memory under 150 MB;
- attributing 16 GPU processes to their tasks, as every scheduling step does: against one pass over /proc (the
  way it was done before), whose cost grows with the machine's process count.

    python benchmarks/server_bench.py [--decision-only] [--against REV]

`--against REV` times the decision with the core of a git revision too (the previous release's tag, say),
in the same run, and prints the ratio: each side runs three times, alternately, and keeps its best median.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from carma.core import GpuSample, ProcessExit, Scheduler, SchedulerConfig, TaskSpec
from carma.server.client import Client, ClientError
from options import machine_line

CARMA = str(Path(sys.executable).parent / "carma")
ROOT = Path(__file__).resolve().parent.parent
SLEEP = "3600"  # the running tasks' length: they are cancelled when the benchmark ends


def start_server(home: Path, gpus: str, *options: str) -> subprocess.Popen[bytes]:
    """A server on `home`, once it answers; one that exits first is reported with its last line."""
    env = {**os.environ, "CARMA_HOME": str(home)}
    log = (home / "bench-server.log").open("wb")
    proc = subprocess.Popen([CARMA, "server", "--fake-gpus", gpus, *options], env=env, stdout=log, stderr=log)
    client = Client(home / "carma.sock")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            lines = (home / "bench-server.log").read_text().strip().splitlines() or ["no output"]
            raise RuntimeError(f"the server exited ({proc.returncode}): {lines[-1]}")
        try:
            client.status()
            return proc
        except ClientError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("the server did not answer within 20 s")


def stop_server(proc: subprocess.Popen[bytes], home: Path) -> None:
    """Cancel the benchmark's tasks through the server (they outlive a daemon's stop, for its restart to
    pick up), then stop it: nothing else on the machine is touched."""
    client = Client(home / "carma.sock")
    try:
        if ids := [t["id"] for t in client.tasks()]:
            client.cancel_many(ids)
            client.wait(ids, timeout_s=60)
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def bench_submit_and_queue(home: Path) -> None:
    proc = start_server(home, "8xA100-40GB")
    client = Client(home / "carma.sock")
    spec = {"command": ["sleep", SLEEP], "workdir": "/tmp", "gpus": 1, "mem": "2GiB"}
    try:
        start = time.perf_counter()
        for _ in range(1000):
            client.submit(spec)
        elapsed = time.perf_counter() - start
        print(f"submit 1,000 tasks through the API: {1000 / elapsed:,.0f} submissions/s (target >= 200)")
        queued = len(client.tasks())
        env = {**os.environ, "CARMA_HOME": str(home)}
        times = []
        for _ in range(5):
            t = time.perf_counter()
            subprocess.run([CARMA, "queue"], env=env, stdout=subprocess.DEVNULL, check=True)
            times.append(time.perf_counter() - t)
        print(f"`carma queue` with {queued} tasks: {1000 * statistics.median(times):.0f} ms median of 5 (target < 300)")
    finally:
        stop_server(proc, home)


def _gpus(n: int) -> tuple[list[Any], list[Any]]:
    """`n` A100s as the core of either side of `--against` takes them, and the names samples give them: since
    targets have identity, `Target`s by id; before, `GpuInfo`s by index."""
    import carma.core

    if hasattr(carma.core, "Target"):
        ids = [f"GPU-{i}" for i in range(n)]
        return [carma.core.Target(g, "A100-40GB", 40960) for g in ids], ids
    return [carma.core.GpuInfo(i, "A100-40GB", 40960) for i in range(n)], list(range(n))


def bench_decision() -> float:
    """decide() with 8 GPUs and 1,000 queued tasks, alternating placements and blocked heads; prints the
    figures and returns the median (s)."""
    targets, gpus = _gpus(8)
    sched = Scheduler(targets, SchedulerConfig())
    now = 0.0
    for task in range(1000):
        sched.submit(TaskSpec(f"t{task}", 1, None), now)
    times = []
    running: list[int] = []
    while len(times) < 400:
        now += 1.0
        for g in gpus:
            sched.record_sample(GpuSample(g, now, 8000, 40960, 0.4, 0.2, 0.2))
        for task_id in running:
            for gpu in sched.task(task_id).current.gpus:
                sched.record_gpu_processes(gpu, [task_id], 0, now)
        t = time.perf_counter()
        launches = sched.decide(now)
        times.append(time.perf_counter() - t)
        running += [launch.task_id for launch in launches]
        if len(sched.queue) < 900:  # keep 1,000 waiting: finish the oldest and submit new ones
            for task_id in running[:8]:
                sched.record_exit(task_id, ProcessExit(0), now)
                sched.submit(TaskSpec("more", 1, None), now)
            running = running[8:]
    placing = [t for t in times if t > 0]
    median = statistics.median(placing)
    print(
        f"one decision, 8 GPUs, ~1,000 queued: median {1e6 * median:.0f} us, "
        f"p99 {1e6 * sorted(placing)[int(0.99 * len(placing))]:.0f} us over {len(placing)} decisions (target < 1 ms)"
    )
    return median


def decision_median(src: Path | None) -> float:
    """The decision's median (s) in a fresh process, with the core under `src` (None: this checkout's)."""
    env = {**os.environ, "PYTHONPATH": str(src)} if src else dict(os.environ)
    out = subprocess.run(
        [sys.executable, __file__, "--decision-only"], env=env, capture_output=True, text=True, check=True
    ).stdout
    return float(out.split()[-1])


def compare_decision(rev: str) -> None:
    """This checkout's decision against revision `rev`'s, each side's best median of three alternate runs."""
    archive = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, capture_output=True, check=False)
    if archive.returncode:
        raise SystemExit(f"error: git archive {rev}: {archive.stderr.decode().strip()}")
    with tempfile.TemporaryDirectory(prefix="carma-bench-") as old:
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(old, filter="data")
        runs = [(decision_median(Path(old) / "src"), decision_median(None)) for _ in range(3)]
    before, now = min(r[0] for r in runs), min(r[1] for r in runs)
    print(f"one decision against {rev}: {1e6 * now:.1f} us now, {1e6 * before:.1f} us then: {now / before:.2f}x")


def bench_idle(home: Path, seconds: float = 30.0) -> None:
    proc = start_server(home, "8xA100-40GB")
    try:
        time.sleep(3)
        before, t = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(seconds)
        share = (cpu_seconds(proc.pid) - before) / (time.monotonic() - t)
        print(
            f"idle daemon, 8 fake GPUs at 1 Hz, over {seconds:g} s: {100 * share:.2f}% of one core (target < 2%), "
            f"resident memory {rss_mb(proc.pid):.0f} MB (target < 150)"
        )
    finally:
        stop_server(proc, home)


SPAWN_ONE = "import subprocess, sys; subprocess.run(['sleep', '600'])"  # a shim and its one child


def bench_attribution(jobs: int = 16, rounds: int = 200) -> None:
    """`proctree.owners` for `jobs` GPU processes, each a child of a shim, against one pass over /proc."""
    from carma.server import proctree

    shims = [subprocess.Popen([sys.executable, "-c", SPAWN_ONE]) for _ in range(jobs)]
    try:
        gpu_pids = []
        for shim in shims:  # its child, once it runs
            while not (children := [p for p, st in proctree.snapshot().items() if st.ppid == shim.pid]):
                time.sleep(0.01)
            gpu_pids.append(children[0])
        roots = {shim.pid: i for i, shim in enumerate(shims)}
        assert proctree.owners(gpu_pids, roots) == {pid: i for i, pid in enumerate(gpu_pids)}
        chains = _median_time(lambda: proctree.owners(gpu_pids, roots), rounds)
        whole = _median_time(proctree.snapshot, rounds)
    finally:
        for shim in shims:
            shim.kill()
            shim.wait()
    processes = len(proctree.snapshot())
    print(
        f"attributing {jobs} GPU processes to their tasks: {1e3 * chains:.2f} ms by their parent chains, "
        f"{1e3 * whole:.2f} ms for one pass over /proc ({processes} processes here): {whole / chains:.1f}x"
    )


def _median_time(run: Callable[[], object], rounds: int) -> float:
    """The median time of `run()` over `rounds` calls (s)."""
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decision-only", action="store_true", help="only the scheduling decision: no server")
    parser.add_argument("--against", metavar="REV", help="also time the decision with git revision REV's core")
    args = parser.parse_args()
    if args.decision_only:
        print(bench_decision())  # its last word is the median, for `--against`
        return
    print(machine_line())
    if args.against:
        compare_decision(args.against)
        return
    for bench in (bench_submit_and_queue, bench_idle):
        home = Path(tempfile.mkdtemp(prefix="carma-bench-"))
        try:
            bench(home)
        finally:
            shutil.rmtree(home, ignore_errors=True)
    bench_decision()
    bench_attribution()


if __name__ == "__main__":
    main()
