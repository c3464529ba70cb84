"""SMACT, SMOCC, DRAMA and GRACT from DCGM, for GPUs without NVML's GPU Performance Monitoring (before Hopper).

One long-running `dcgmi dmon` streams the profiling fields (1001 graphics engine activity, 1002 SM activity,
1003 SM occupancy, 1005 DRAM activity) once a second, in that order; a reader thread keeps the latest values
per GPU. One subprocess for the daemon's lifetime, never one per sample.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
from collections import deque
from collections.abc import Iterable

FIELDS = {1001: "gract", 1002: "smact", 1003: "smocc", 1005: "drama"}
STARTUP_S = 3.0  # how long the start waits for dmon's first values, or for it to end (no host engine, say)
log = logging.getLogger("carma.dcgm")


def parse_dmon_line(line: str) -> tuple[int, dict[str, float | None]] | None:
    """One `dcgmi dmon` data line, e.g. `GPU 0   0.512   0.201   0.100`, as (gpu index, metrics).

    Header lines (`#Entity ...`, `ID ...`) and anything else give None; a field DCGM cannot read (`N/A`)
    gives None for that metric.
    """
    words = line.split()
    if len(words) < 2 + len(FIELDS) or words[0] != "GPU" or not words[1].isdigit():
        return None
    values: dict[str, float | None] = {}
    for name, word in zip(FIELDS.values(), words[2 : 2 + len(FIELDS)], strict=True):
        try:
            values[name] = float(word)
        except ValueError:
            values[name] = None
    return int(words[1]), values


class DcgmDmon:
    """The latest DCGM profiling metrics per GPU index, from one streaming `dcgmi dmon` process."""

    def __init__(self, gpu_indices: Iterable[int], interval_ms: int = 1000, binary: str = "dcgmi") -> None:
        path = shutil.which(binary)
        if path is None:
            raise FileNotFoundError(f"{binary} not found: install DCGM for SMACT/SMOCC/DRAMA on this GPU")
        fields = ",".join(str(f) for f in FIELDS)
        gpus = ",".join(str(i) for i in gpu_indices)
        self._proc = subprocess.Popen(
            [path, "dmon", "-e", fields, "-i", gpus, "-d", str(interval_ms)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,  # its errors ("Unable to connect ...") are the reason it stopped
            text=True,
        )
        self._latest: dict[int, dict[str, float | None]] = {}
        self._said: deque[str] = deque(maxlen=3)  # the last lines that were neither data nor headers
        self._lock = threading.Lock()
        self._started = threading.Event()  # first values, or the end of the stream
        self._death_logged = False
        threading.Thread(target=self._read, name="dcgmi-dmon", daemon=True).start()
        if self._started.wait(STARTUP_S) and not self._latest:  # it ended before giving values
            self._proc.wait()
            raise OSError(f"dcgmi dmon stopped at once: {self.reason()}")

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            parsed = parse_dmon_line(line)
            if parsed:
                with self._lock:
                    self._latest[parsed[0]] = parsed[1]
                self._started.set()
            elif line.strip() and not line.lstrip().startswith(("#", "ID")):
                self._said.append(" ".join(line.split()))
        self._started.set()

    def reason(self) -> str:
        """What dmon said that was no data (its error, when it stopped), or its exit status."""
        return "; ".join(self._said) or f"exit status {self._proc.poll()}"

    def alive(self) -> bool:
        """Whether dmon still streams (it exits at once when, e.g., no DCGM host engine runs)."""
        return self._proc.poll() is None

    def latest(self, gpu: int) -> dict[str, float | None] | None:
        """The newest values for a GPU, or None before dmon's first line or after it died (said once)."""
        if not self.alive():
            if not self._death_logged:
                self._death_logged = True
                log.warning("dcgmi dmon stopped (%s): SMACT/SMOCC/DRAMA are missing from now on", self.reason())
            return None
        with self._lock:
            return self._latest.get(gpu)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
