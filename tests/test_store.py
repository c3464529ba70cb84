"""The daemon's SQLite store: what is written comes back after a restart."""

from __future__ import annotations

import sqlite3

import pytest

from carma.core.types import Attempt, ExitKind, MemoryNeed, NeedKind, Task, TaskState
from carma.estimate.base import Breakdown, Estimate
from carma.server.spec import JobSpec
from carma.server.store import Observation, Spawn, Store

JOB = JobSpec(
    "train", ("python", "train.py", "--lr", "0.1"), "/work", 2, 8192, {"SEED": "1"}, False, 1001, 1001, "alice"
)


@pytest.fixture
def path(tmp_path):
    return tmp_path / "carma.db"


def test_a_job_added_comes_back_queued_with_its_spec(path):
    store = Store(path)
    task_id = store.add(JOB, 100.0)
    store.close()
    (stored,) = Store(path).load()
    assert stored.job == JOB
    assert (stored.task.id, stored.task.state, stored.task.submit_s) == (task_id, TaskState.QUEUED, 100.0)
    assert stored.task.spec.gpus == 2 and stored.task.spec.mem_mib == 8192


def test_states_attempts_and_processes_round_trip(path):
    store = Store(path)
    task_id = store.add(JOB, 0.0)
    (stored,) = store.load()
    task = stored.task
    need = MemoryNeed(NeedKind.KNOWN, 8192, "xmem", partial=True)  # a two-GPU job's capture: its margin held
    task.attempts.append(Attempt(1, ("GPU-a", "GPU-b"), 10.0, exclusive=False, recovery=False, need=need, shared=True))
    task.state = TaskState.DISPATCHED
    store.save([task])
    store.record_spawn(task_id, 1, Spawn(4242, 123456, "/state/tasks/1/1"))
    task.attempts[0].first_kernel_s = 15.0
    task.attempts[0].ended_s, task.attempts[0].outcome = 40.0, ExitKind.OOM
    task.attempts[0].message = "torch.OutOfMemoryError: CUDA out of memory."
    task.attempts[0].restart_mib = 30_000  # stopped on a predicted growth: its relaunch holds that peak
    task.state = TaskState.RECOVERING
    store.save([task])
    store.close()
    (again,) = Store(path).load()
    assert again.task.state is TaskState.RECOVERING
    assert again.task.attempts == task.attempts  # every field, the need included
    assert again.spawns == {1: Spawn(4242, 123456, "/state/tasks/1/1")}


def test_what_telemetry_saw_round_trips_and_older_databases_gain_gract(path):
    """GRACT (the interference model's input) joined the observed means later: a database without its column
    gains it, and a run's means come back from the store and in the history."""
    Store(path).close()
    old = sqlite3.connect(path)
    old.execute("ALTER TABLE attempts DROP COLUMN gract_mean")  # the table as an earlier release made it
    old.close()
    store = Store(path)
    task_id = store.add(JOB, 0.0)
    (stored,) = store.load()
    task = stored.task
    task.attempts.append(Attempt(1, ("GPU-a",), 10.0, exclusive=False, recovery=False, ended_s=40.0))
    task.attempts[0].outcome, task.state = ExitKind.SUCCESS, TaskState.COMPLETED
    store.save([task])
    seen = Observation(4096, 0.6, 0.2, 0.3, samples=30, gract_mean=0.75)
    store.record_observation(task_id, 1, seen)
    store.close()
    store = Store(path)
    assert store.load()[0].observed == {1: seen}
    (run,) = store.history()
    assert (run["smact_mean"], run["gract_mean"], run["peak_mib"]) == (0.6, 0.75, 4096)
    store.close()
    old = sqlite3.connect(path)
    old.execute("ALTER TABLE attempts DROP COLUMN gract_mean")
    old.close()
    (unmigrated,) = Store(path, readonly=True).load()  # `carma server --check` of the earlier release's state
    assert unmigrated.observed == {1: Observation(4096, 0.6, 0.2, 0.3, samples=30)}


def _placed(path) -> tuple[Store, Task]:
    """A store holding one task, dispatched to GPU-a (its first attempt not started yet)."""
    store = Store(path)
    store.add(JOB, 0.0)
    task = store.load()[0].task
    task.attempts.append(Attempt(1, ("GPU-a",), 5.0, exclusive=True, recovery=False))
    task.state = TaskState.DISPATCHED
    store.save([task])
    return store, task


def test_a_need_stored_before_partial_needs_reads_as_complete(path):
    """Attempts stored by an earlier release have no `partial` in their need: they hold no margin."""
    store, task = _placed(path)
    store._db.execute(
        "UPDATE attempts SET need = ? WHERE task_id = ?", ('{"kind": "known", "mib": 8192, "source": "xmem"}', task.id)
    )
    (again,) = store.load()
    assert again.task.attempts[0].need == MemoryNeed(NeedKind.KNOWN, 8192, "xmem", partial=False)


def test_dropping_a_placement_that_never_started(path):
    store, task = _placed(path)
    task.attempts.pop()
    task.state = TaskState.QUEUED
    store.drop_attempt(task, 1)
    (again,) = store.load()
    assert (again.task.id, again.task.state, again.task.attempts) == (task.id, TaskState.QUEUED, [])


def test_ids_continue_after_a_restart_and_events_follow_state_changes(path):
    store = Store(path)
    first = store.add(JOB, 0.0)
    task = store.load()[0].task
    store.save([task])  # unchanged state: no new event
    task.state, task.reason, task.ended_s = TaskState.CANCELLED, "cancelled by request", 3.0
    store.save([task])
    store.close()
    reopened = Store(path)
    assert reopened.add(JOB, 5.0) == first + 1
    events = sqlite3.connect(path).execute("SELECT task_id, state, detail FROM events ORDER BY id").fetchall()
    assert events == [(1, "queued", ""), (1, "cancelled", "cancelled by request"), (2, "queued", "")]


def test_meta_values_and_the_database_mode(path):
    store = Store(path)
    assert store.meta("clock") is None and store.meta("clock", 1) == 1
    store.set_meta("gpus", ["GPU-a", "GPU-b"])
    assert Store(path).meta("gpus") == ["GPU-a", "GPU-b"]
    assert sqlite3.connect(path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_estimates_keep_their_notes_and_older_databases_gain_the_column(path):
    old = sqlite3.connect(path)  # the estimates table as the first release made it, with one row
    old.execute(
        "CREATE TABLE estimates (fingerprint TEXT PRIMARY KEY, method TEXT NOT NULL, device TEXT NOT NULL, "
        "peak_bytes INTEGER NOT NULL, breakdown TEXT NOT NULL, seconds REAL NOT NULL, t REAL NOT NULL)"
    )
    old.execute("INSERT INTO estimates VALUES ('old', 'xmem', 'a100-40gb', 1024, '{\"parameters\": 1024}', 2.0, 0)")
    old.commit()
    old.close()
    store = Store(path)
    assert store.estimate("old") == Estimate("xmem", 1024, Breakdown(parameters=1024), "a100-40gb", 2.0)
    noted = Estimate("xmem", 2048, Breakdown(activations=2048), "h100-80gb", 3.5, ("CUDA autocast ran in float32",))
    store.add_estimate("new", noted, 1.0)
    store.close()
    assert Store(path).estimate("new") == noted


def test_an_estimate_row_that_is_no_estimate_is_made_again_not_loaded(path):
    """An earlier release kept what a capture child wrote unchecked (the job's own code may write it): such a
    row stopped the server at every start; it now reads as no estimate, which is made again."""
    store = Store(path)
    store.add_estimate("forged", Estimate("xmem", "boom", Breakdown(), "d", 1.0), 0.0)  # type: ignore[arg-type]
    store.add_estimate("fine", Estimate("xmem", 1024, Breakdown(parameters=1024), "d", 1.0), 0.0)
    assert store.estimate("forged") is None and store.estimate("fine").peak_bytes == 1024


def _ended(store: Store, task_id: int, state: TaskState, ended_s: float) -> None:
    task = next(s.task for s in store.load() if s.task.id == task_id)
    task.attempts.append(Attempt(1, ("GPU-a",), ended_s - 1, exclusive=True, recovery=False, ended_s=ended_s))
    task.state, task.ended_s = state, ended_s
    store.save([task])


def test_forgotten_tasks_leave_every_table_and_their_ids_are_not_reused(path):
    store = Store(path)
    old, shared, kept = (store.add(JOB, 0.0) for _ in range(3))
    estimate = Estimate("xmem", 1024, Breakdown(parameters=1024), "a100-40gb", 1.0)
    store.add_estimate("mine", estimate, 0.0)
    store.add_estimate("ours", estimate, 0.0)
    store.link_estimate(old, "mine")
    store.link_estimate(shared, "ours")
    store.link_estimate(kept, "ours")
    _ended(store, old, TaskState.COMPLETED, 10.0)
    _ended(store, shared, TaskState.FAILED, 20.0)
    assert store.forget([old, shared], {"completed": 1, "failed": 1, "oom_crashes": 2}) == ["mine"]
    assert store.forget([], {"completed": 1}) == []
    assert [s.task.id for s in store.load()] == [kept]
    assert store.history() == [] and store.task_estimate(kept) == estimate
    assert store.estimate("mine") is None  # no task left uses it
    db = sqlite3.connect(path)
    assert db.execute("SELECT DISTINCT task_id FROM events").fetchall() == [(kept,)]
    assert db.execute("SELECT count(*) FROM attempts").fetchone() == (0,)
    _ended(store, kept, TaskState.CANCELLED, 30.0)
    store.forget([kept], {"cancelled": 1})
    store.close()
    reopened = Store(path)  # every task forgotten: the next id still follows the last one given
    assert reopened.add(JOB, 40.0) == kept + 1
    assert reopened.forgotten() == {"completed": 2, "failed": 1, "cancelled": 1, "oom_crashes": 2}


def test_a_database_of_the_release_before_targets_names_its_gpus_by_uuid(path):
    """0.x kept attempts and samples by the GPU's index; opened now, each index becomes the UUID of the GPU its
    daemon last started with at that index, and the tasks and history are all still there."""
    store = Store(path)
    task_id = store.add(JOB, 0.0)
    task = store.load()[0].task
    task.attempts.append(Attempt(1, ("x",), 5.0, exclusive=False, recovery=False, ended_s=9.0, outcome=ExitKind.OOM))
    task.state = TaskState.RECOVERING
    store.save([task])
    store.set_meta("gpus", ["GPU-a", "GPU-b"])
    store.close()
    db = sqlite3.connect(path)  # as the release before wrote it: indices, and no schema version
    db.execute("UPDATE attempts SET gpus = '[1, 0]'")
    db.execute("DELETE FROM meta WHERE key = 'schema'")
    db.execute("DROP TABLE gpu_samples")
    db.execute(
        "CREATE TABLE gpu_samples (gpu INTEGER NOT NULL, t REAL NOT NULL, used_mib INTEGER NOT NULL, total_mib "
        "INTEGER NOT NULL, smact REAL, smocc REAL, drama REAL, power_w REAL, energy_j REAL, temperature_c REAL, "
        "PRIMARY KEY (t, gpu))"
    )
    db.execute("INSERT INTO gpu_samples (gpu, t, used_mib, total_mib) VALUES (1, 60.0, 100, 40960)")
    db.execute("INSERT INTO gpu_samples (gpu, t, used_mib, total_mib) VALUES (7, 60.0, 5, 40960)")  # never was
    db.commit()
    db.close()

    store = Store(path)
    (stored,) = store.load()
    assert stored.task.id == task_id and stored.task.state is TaskState.RECOVERING
    assert stored.task.attempts[0].gpus == ("GPU-b", "GPU-a")
    assert [run["gpus"] for run in store.history()] == [["GPU-b", "GPU-a"]]
    assert store.gpu_series(0.0)["GPU-b"]["used_mib"] == [100]
    assert set(store.gpu_series(0.0)) == {"GPU-b", "gpu-index-7"}
    store.close()
    assert Store(path).load()[0].task.attempts[0].gpus == ("GPU-b", "GPU-a")  # migrated once, kept
