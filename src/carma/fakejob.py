"""A stand-in training job for fake GPUs: `carma fakejob --mem 8GiB --seconds 600` (or `python -m carma.fakejob`).

It lives like a PyTorch job on the GPUs in CUDA_VISIBLE_DEVICES (fake UUIDs; the device directory and
time scale come from CARMA_FAKE_GPUS and CARMA_TIME_SCALE): after its time to first kernel it shows with
its CUDA context and weights (`--mem-first`), after a warm-up it holds all its memory (`--mem`), then
it computes at a speed its co-runners set until its solo work is done. An allocation that does not fit
ends it the way PyTorch ends: a traceback with the CUDA out-of-memory message and exit status 1.
Times are simulated seconds; wall time is simulated time divided by the time scale. They count from the
launch (CARMA_LAUNCHED_AT, which carma sets), as a real job's time to first kernel includes its interpreter's
start-up: this job's own start-up, which a time scale would multiply, is not added to them.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Sequence
from types import FrameType

from carma.server.shim import LAUNCHED_AT
from carma.sim.models import Load
from carma.telemetry.fake import ENV_ROOT, ENV_TIME_SCALE, MIG_UUID_PREFIX, UUID_PREFIX, FakeDevice
from carma.units import parse_mib

TICK_S = 0.05  # wall seconds between progress updates
STEPS = 10  # progress lines printed over the compute phase
SIGTERM_EXIT = 128 + signal.SIGTERM


class UsageError(Exception):
    """The job cannot run where it was started: exit 2 with one line on stderr."""


class OutOfMemory(Exception):
    """An allocation did not fit: the message is PyTorch's."""


def main(argv: Sequence[str] | None = None, prog: str = "python -m carma.fakejob") -> int:
    signal.signal(signal.SIGTERM, _on_sigterm)
    args = _parser(prog).parse_args(argv)
    try:
        device, uuids, scale = _environment()
    except UsageError as e:
        print(f"fakejob: error: {e}", file=sys.stderr)
        return 2
    pid = os.getpid()
    try:
        _run(args, device, uuids, scale, pid)
    except OutOfMemory as e:
        print(_traceback(str(e)), file=sys.stderr, flush=True)
        return 1
    finally:
        device.release(pid)
    if args.exit_code:
        print(f"RuntimeError: fakejob failing on purpose (--exit-code {args.exit_code})", file=sys.stderr)
    return args.exit_code


def _size(text: str) -> int:
    """A memory size with its unit, in MiB: `--mem 8` is refused, not read as 8 MiB."""
    try:
        return parse_mib(text, bare_mib=False)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("--mem", type=_size, required=True, help="GPU memory per GPU (e.g. 8GiB)")
    parser.add_argument("--seconds", type=float, required=True, help="solo duration, start-up included")
    parser.add_argument("--ttfk", type=float, default=2.0, help="seconds to the first kernel (default 2)")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds from first kernel to full memory")
    parser.add_argument("--mem-first", type=_size, help="memory at the first kernel (default min(512MiB, mem))")
    parser.add_argument("--gract", type=_fraction, default=0.5, help="solo GPU utilization (default 0.5)")
    parser.add_argument("--smact", type=_fraction, default=0.4, help="solo SM activity (default 0.4)")
    parser.add_argument("--smocc", type=_fraction, default=0.15, help="solo SM occupancy (default 0.15)")
    parser.add_argument("--drama", type=_fraction, default=0.3, help="solo memory bandwidth use (default 0.3)")
    parser.add_argument("--exit-code", type=int, default=0, help="exit with this status at the end (default 0)")
    parser.add_argument(
        "--grow-to",
        type=_size,
        help="memory grows as it computes, linearly in its progress, to this (e.g. 12GiB)",
    )
    return parser


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction in [0, 1]")
    return value


def _environment() -> tuple[FakeDevice, list[str], float]:
    """The fake device, this job's GPUs on it and the time scale, from the environment the daemon set."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    uuids = [u.strip() for u in visible.split(",") if u.strip()]
    if not uuids:
        raise UsageError("CUDA_VISIBLE_DEVICES is not set; run me on fake GPUs (carma sets it)")
    if not all(u.startswith((UUID_PREFIX, MIG_UUID_PREFIX)) for u in uuids):
        raise UsageError(f"CUDA_VISIBLE_DEVICES={visible} names no fake GPUs ({UUID_PREFIX}..., {MIG_UUID_PREFIX}...)")
    root = os.environ.get(ENV_ROOT)
    if not root:
        raise UsageError(f"{ENV_ROOT} is not set; it names the fake device's directory")
    try:
        device = FakeDevice.open(root)
        for uuid in uuids:
            device.index_of(uuid)
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    scale = float(os.environ.get(ENV_TIME_SCALE) or device.time_scale)
    if not scale > 0:
        raise UsageError(f"{ENV_TIME_SCALE} must be positive, got {scale}")
    return device, uuids, scale


def _run(args: argparse.Namespace, device: FakeDevice, uuids: list[str], scale: float, pid: int) -> None:
    """Start-up, warm-up and the compute phase, in simulated time."""
    mem_first = min(args.mem_first or 512, args.mem)
    time.sleep(max(0.0, _launched_at() + args.ttfk / scale - time.time()))
    _allocate(device, pid, uuids, mem_first)
    time.sleep(args.warmup / scale)
    _allocate(device, pid, uuids, args.mem)
    device.set_load(pid, Load(args.gract, args.smact, args.smocc, args.drama))
    grow = (uuids, args.mem, args.grow_to) if args.grow_to and args.grow_to > args.mem else None
    _compute(device, pid, max(0.0, args.seconds - args.ttfk - args.warmup), scale, grow)


def _launched_at() -> float:
    """When carma launched this job (Unix time), else now: started by hand, its start-up is not counted."""
    now = time.time()
    try:
        return min(now, float(os.environ[LAUNCHED_AT]))
    except (KeyError, ValueError):
        return now


def _allocate(device: FakeDevice, pid: int, uuids: list[str], mib: int) -> None:
    ok, message = device.allocate(pid, uuids, mib)
    if not ok:
        raise OutOfMemory(message)


def _compute(
    device: FakeDevice, pid: int, work_s: float, scale: float, grow: tuple[list[str], int, int] | None = None
) -> None:
    """Progress at the device's speed for this job until `work_s` solo seconds of work are done; with `grow`
    (its GPUs, memory from and to), allocating more as it progresses, as a job with a growing context does."""
    done, step, held = 0.0, 0, grow[1] if grow else 0
    last = time.monotonic()
    while done < work_s:
        speed = device.speed(pid)
        time.sleep(min(TICK_S, (work_s - done) / (scale * speed)))
        now = time.monotonic()
        done += (now - last) * scale * speed
        last = now
        if grow is not None and (want := round(grow[1] + (grow[2] - grow[1]) * min(1.0, done / work_s))) > held:
            _allocate(device, pid, grow[0], want)
            held = want
        reached = min(STEPS, int(done / work_s * STEPS))
        if reached > step:
            step = reached
            print(f"step {step}/{STEPS}: {min(done, work_s):.1f}/{work_s:.1f} s of work, speed {speed:.2f}", flush=True)


def _traceback(message: str) -> str:
    """What a PyTorch script prints when it dies of an out-of-memory error."""
    return (
        f'Traceback (most recent call last):\n  File "train.py", line 42, in <module>\n    loss.backward()\n{message}'
    )


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Stop like a training script that handles SIGTERM: the finally clause releases the memory.

    os.write, not print: a signal landing inside a print to stderr would make print re-enter the stream and
    raise RuntimeError instead of stopping cleanly."""
    os.write(sys.stderr.fileno(), b"received SIGTERM\n")
    raise SystemExit(SIGTERM_EXIT)


if __name__ == "__main__":
    sys.exit(main())
