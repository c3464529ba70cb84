"""What the dashboard and Prometheus read: the archived GPU series, the /metrics exposition, and the
store's upgrade of a database written by the first release."""

from __future__ import annotations

import sqlite3
import time
from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from carma.core import SchedulerConfig
from carma.core.types import GpuSample
from carma.server.archive import SampleArchive
from carma.server.daemon import Daemon
from carma.server.dashboard import SERIES_POINTS, series_step
from carma.server.metrics import Metrics
from carma.server.paths import Paths
from carma.server.spec import JobSpec
from carma.server.store import Store
from carma.sim.gpus import parse_gpus
from carma.telemetry import DeviceReading
from carma.telemetry.fake import FakeDevice, FakeGpuBackend, fake_env


def reading(gpu: str, t: float, used: int, smact: float | None, energy: float | None = None) -> DeviceReading:
    sample = GpuSample(gpu, t, used, 40960, smact, smact, smact, 100.0 + used / 100, energy, 40.0 + t / 10)
    return DeviceReading(sample, ())


def test_the_archive_keeps_one_row_per_gpu_and_bucket(tmp_path):
    store = Store(tmp_path / "carma.db")
    archive = SampleArchive(store, bucket_s=10)
    for t in range(0, 25):
        smact = None if t in (3, 4) else t / 100
        archive.observe(
            [reading("G0", float(t), 1000 * (t % 7), smact, energy=float(t)), reading("G1", float(t), 0, None)]
        )
    series = store.gpu_series(0.0)
    gpu0, gpu1 = series["G0"], series["G1"]
    assert gpu0["t"] == [0.0, 10.0]  # the bucket starting at 20 is still open
    assert gpu0["used_mib"] == [6000, 6000]  # the most used in the bucket
    assert gpu0["smact"][0] == pytest.approx(sum(t / 100 for t in range(10) if t not in (3, 4)) / 8)  # gaps skipped
    assert gpu0["energy_j"] == [9.0, 19.0] and gpu0["temperature_c"] == [40.9, 41.9]
    assert gpu1["smact"] == [None, None]  # missing stays missing, never 0
    assert store.gpu_series(5.0, 15.0)["G0"]["t"] == [10.0]


def test_a_long_window_merges_buckets_into_steps_as_the_archive_merges_samples(tmp_path):
    """A month of ten-second buckets of 8 GPUs (2 million rows) took 10 s to send: a window holding more
    than `SERIES_POINTS` buckets a GPU is sent in longer steps, each a whole number of buckets."""
    store = Store(tmp_path / "carma.db")
    archive = SampleArchive(store, bucket_s=10)
    for t in range(0, 45):
        archive.observe([reading("G0", float(t), 1000 * (t % 7), None if t < 10 else 0.5, energy=float(t))])
    merged = store.gpu_series(0.0, step_s=20)["G0"]
    assert merged["t"] == [0.0, 20.0] and merged["used_mib"] == [6000, 6000]  # the buckets from 0 and 10, 20 and 30
    assert merged["smact"] == [0.5, 0.5]  # the bucket without SMACT left out of the mean, not read as 0
    assert merged["energy_j"] == [9.0, 29.0]  # the counter as it read at the step's time: its first bucket's
    assert merged["temperature_c"] == [41.9, 43.9]
    assert (series_step(3600, 10), series_step(SERIES_POINTS * 10, 10)) == (None, None)
    assert series_step(SERIES_POINTS * 10 + 1, 10) == 20 and series_step(30 * 86400, 10) == 650


def test_the_archive_forgets_rows_older_than_it_keeps(tmp_path):
    store = Store(tmp_path / "carma.db")
    archive = SampleArchive(store, bucket_s=10, keep_s=100)
    for t in range(0, 300, 5):
        archive.observe([reading("G0", float(t), 100, 0.5)])
    assert store.gpu_series(0.0)["G0"]["t"][0] == 180.0  # rows from before (last bucket 280) - 100 are gone


class WithoutProfiling(FakeGpuBackend):
    """Fake GPUs whose driver reports no SMACT/SMOCC/DRAMA (an A100 without DCGM)."""

    def read(self, now):  # type: ignore[no-untyped-def]
        return [
            DeviceReading(replace(r.sample, smact=None, smocc=None, drama=None, gract=None), r.processes)
            for r in super().read(now)
        ]

    def missing(self):  # type: ignore[no-untyped-def]
        return {g.id: ("smact", "smocc", "drama") for g in self.gpus()}


@pytest.fixture
def daemon(tmp_path):  # type: ignore[no-untyped-def]
    paths = Paths(tmp_path / "home")
    paths.create()
    FakeDevice.create(paths.fake_gpus, parse_gpus("2xA100-40GB"), time_scale=10.0)
    d = Daemon(paths, WithoutProfiling(paths.fake_gpus), SchedulerConfig(), 10.0, fake_env(paths.fake_gpus))
    yield d
    d.close()


def scrape(daemon: Daemon) -> dict[str, list]:
    text = Metrics(daemon).render().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_metrics_export_gpus_tasks_and_decisions_and_leave_missing_metrics_out(daemon, tmp_path):
    task = daemon.submit(JobSpec("quick", ("true",), str(tmp_path)))
    deadline = time.monotonic() + 20
    while daemon.scheduler.task(task.id).state.value != "completed" and time.monotonic() < deadline:
        daemon.step()
        time.sleep(0.05)
    families = scrape(daemon)
    used = {s.labels["gpu"]: s.value for s in families["carma_gpu_memory_used_bytes"]}
    assert set(used) == {"0", "1"} and families["carma_gpu_memory_total_bytes"][0].value == 40960 * 2**20
    assert families["carma_gpu_sm_active_ratio"] == families["carma_gpu_graphics_active_ratio"] == []  # absent, not 0
    assert all(s.value > 0 for s in families["carma_gpu_power_watts"])
    ended = {s.labels["outcome"]: s.value for s in families["carma_tasks_ended"] if s.name.endswith("_total")}
    assert ended == {"completed": 1.0, "failed": 0.0, "cancelled": 0.0}
    states = {s.labels["state"]: s.value for s in families["carma_tasks"]}
    assert states["completed"] == 1.0 and states["queued"] == 0.0
    decisions = {s.name: s.value for s in families["carma_decision_seconds"]}
    assert decisions["carma_decision_seconds_count"] >= 1
    assert all(name.startswith("carma_") for name in families)
    assert "carma_decision_seconds_created" not in families  # prometheus_client's default, in no table of ours
    assert families["carma_gpu_risk_excluded"][0].value in (0.0, 1.0)


def test_a_live_event_holds_the_running_tasks_and_the_first_waiting_ones(daemon, tmp_path, monkeypatch):
    """With 10,000 queued, each event of the dashboard's stream was 3.7 MB: the whole queue, every second."""
    from carma.server import dashboard

    monkeypatch.setattr(dashboard, "SNAPSHOT_TASKS", 3)
    daemon.draining = True
    ids = [daemon.submit(JobSpec(f"t{i}", ("true",), str(tmp_path))).id for i in range(5)]
    event = dashboard.snapshot(daemon)
    assert [t["id"] for t in event["tasks"]] == ids[:3] and event["tasks_not_shown"] == 2
    assert event["status"]["tasks"]["queued"] == 5  # what the page counts


def test_a_database_from_the_first_release_is_upgraded_in_place(tmp_path):
    path = tmp_path / "carma.db"
    Store(path).close()
    db = sqlite3.connect(path)
    db.executescript(
        "DROP TABLE attempts; CREATE TABLE attempts (task_id INTEGER NOT NULL, number INTEGER NOT NULL, "
        "gpus TEXT NOT NULL, dispatched_s REAL NOT NULL, exclusive INTEGER NOT NULL, recovery INTEGER NOT NULL, "
        "first_kernel_s REAL, ended_s REAL, outcome TEXT, message TEXT NOT NULL DEFAULT '', need TEXT, "
        "shared INTEGER NOT NULL DEFAULT 0, pid INTEGER, start_ticks INTEGER, run_dir TEXT, "
        "PRIMARY KEY (task_id, number));"
    )
    db.close()
    store = Store(path)
    columns = {row[1] for row in store._db.execute("PRAGMA table_info(attempts)")}
    assert {"peak_mib", "smact_mean", "smocc_mean", "drama_mean"} <= columns
    assert store.history() == []
