"""`carma report`: the run record (from the twin, from a daemon, through JSON), its charts and its page."""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from carma.metrics.timeline import Segment, integrate
from carma.reports.page import write_report
from carma.reports.record import (
    AttemptRecord,
    GpuRef,
    OomEvent,
    RecordError,
    RunRecord,
    TaskRecord,
    from_json,
    from_run_result,
    from_server,
    task_figures,
    to_json,
)
from carma.server.client import Refused
from carma.sim.experiment import RunConfig, simulate
from carma.traces.catalog import load_catalog
from carma.traces.loaders import Trace, load_trace
from servers import fakejob
from support import cli_env, run_carma

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Two custom tasks that cannot share one 40 GB GPU: the later one crashes out of memory and is recovered.
TINY_TRACE = """submit_s,task,gpus,solo_s,mem_mib,gract,smact
0,<b>big</b> & co,1,600,30000,0.5,0.4
60,"<script>alert('late')</script>",1,300,20000,0.5,0.4
90,resnet,,,,,
"""


@pytest.fixture(scope="module")
def small_run():
    """The first 20 tasks of CARMA's trace 1 under RR, recovery only: quick, and it crashes out of memory."""
    trace = load_trace("carma-t1", load_catalog())
    return simulate(Trace("t1-20", trace.entries[:20]), RunConfig("rr"))


def _hand_record() -> RunRecord:
    return RunRecord(
        label="hand <made>",
        source="a test",
        start_s=100.0,
        end_s=400.0,
        gpus=(GpuRef(0, "A100-40GB", 40960), GpuRef(1, "odd", None)),
        figures={"makespan_s": 300.0, "energy_mj": None, "oom_crashes": 1},
        tasks=(
            TaskRecord(
                1,
                "a & b",
                100.0,
                400.0,
                "completed",
                (AttemptRecord((0,), 110.0, 150.0, "oom"), AttemptRecord((1,), 200.0, 400.0, "success")),
            ),
            TaskRecord(2, "queued", 120.0, None, "queued", ()),
        ),
        series={0: {"t": [100.0, 150.0], "used_mib": [0, None], "smact": [None, 0.5], "power_w": [None, None]}},
        ooms=(OomEvent(150.0, (0,), 1),),
    )


# --- the record ----------------------------------------------------------------------------------------


def test_records_round_trip_through_json(small_run):
    records = [_hand_record(), from_run_result(small_run)]
    text = to_json(records)
    assert json.loads(text)["carma_report_version"] == 1
    assert from_json(text) == records


def test_task_figures_follow_the_metric_definitions():
    task = _hand_record().tasks[0]
    assert task.jct_s == 300.0
    assert task.wait_s == 300.0 - 40.0 - 200.0  # queued before both attempts, the recovery queue included
    figures = task_figures(_hand_record().tasks)
    assert figures["jct_mean_s"] == 300.0 and figures["wait_p95_s"] == 60.0
    assert (figures["tasks_completed"], figures["tasks_failed"], figures["tasks_cancelled"]) == (1, 0, 0)
    assert task_figures(_hand_record().tasks[1:])["jct_mean_s"] is None  # nothing completed: not measured, not 0


def test_a_twin_run_becomes_a_record_with_its_figures_tasks_and_crashes(small_run):
    record = from_run_result(small_run, "twin test")
    m = small_run.metrics
    assert record.label == "RR recovery only" and record.source == "twin test"
    assert record.figures == asdict(m)
    assert [g.total_mib for g in record.gpus] == [40960] * 3
    assert record.end_s - record.start_s == pytest.approx(m.makespan_s)
    # the record's own task figures agree with the twin's metrics (one definition of JCT and waiting time)
    for key, value in task_figures(record.tasks).items():
        assert value == pytest.approx(getattr(m, key)), key
    assert m.oom_crashes > 0 and len(record.ooms) == m.oom_crashes
    for oom in record.ooms:
        attempt = next(a for a in record.task(oom.task_id).attempts if a.end_s == oom.t)
        assert attempt.outcome == "oom" and attempt.gpus == oom.gpus


def test_a_twin_timeline_becomes_an_equivalent_step_series(small_run):
    record = from_run_result(small_run)
    assert set(record.series) == {0, 1, 2}
    for gpu, series in record.series.items():
        assert series["t"][-1] == pytest.approx(record.end_s, abs=0.05)
        assert series["t"] == sorted(series["t"])
        steps = [Segment(t, s, 0, 0, u, p, 0) for t, u, s, p in zip(*series.values(), strict=True)]
        timeline = small_run.timelines[gpu]
        for metric in ("used_mib", "smact", "power_w"):  # the same step function: the same integral
            expected = integrate(timeline, metric, record.start_s, record.end_s)
            assert integrate(steps, metric, record.start_s, record.end_s) == pytest.approx(expected, rel=1e-3)


def test_a_twin_timeline_starts_at_the_first_submission_not_at_zero():
    """A trace of real timestamps began its series at 0: the charts' axis ran over the idle hours before."""
    trace = load_trace("carma-t1", load_catalog())
    late = Trace("late", tuple(replace(e, submit_s=e.submit_s + 36_000) for e in trace.entries[:4]))
    record = from_run_result(simulate(late, RunConfig("magm")))
    assert record.start_s == 36_000
    for series in record.series.values():
        assert series["t"][0] == 36_000 and series["t"][-1] == pytest.approx(record.end_s, abs=0.05)


class _Api:
    """A daemon's API answers as they come over the wire. The window is [1000, 4600]: task 1 ended before it,
    task 2 crashed before it and ran again in it, task 3 waits in it."""

    where = "/tmp/fake.sock"

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.summaries = {
            1: {"id": 1, "name": "before", "submit_s": 400.0, "ended_s": 800.0, "state": "completed", "attempts": 1},
            2: {"id": 2, "name": "across", "submit_s": 450.0, "ended_s": 2500.0, "state": "completed", "attempts": 2},
            3: {"id": 3, "name": "waits", "submit_s": 2600.0, "ended_s": None, "state": "queued", "attempts": 0},
        }
        self.crashed = {"gpus": [0], "dispatched_s": 500.0, "ended_s": 900.0, "outcome": "oom"}
        self.rerun = {"gpus": [0, 1], "start_s": 2000.0, "end_s": 2500.0, "outcome": "success"}
        column = {"t": [1000.0, 1010.0], "used_mib": [100, 200], "smact": [None, 0.5], "power_w": [None, None]}
        self.series = {"0": {**column, "energy_j": [5e6, 6e6]}, "1": {**column, "energy_j": [None, None]}}

    def status(self) -> dict:
        return {"policy": "lug", "time_scale": 1.0}

    def gpus(self) -> list[dict]:
        return [{"index": 0, "name": "H100-80GB", "total_mib": 81559}, {"index": 1, "name": "X", "total_mib": 1}]

    def tasks(self, all: bool = False) -> list[dict]:
        return list(self.summaries.values())

    def task(self, task_id: int) -> dict:
        self.asked.append(task_id)
        rerun = {**self.rerun, "dispatched_s": self.rerun["start_s"], "ended_s": self.rerun["end_s"]}
        return {**self.summaries[task_id], "attempt_list": [self.crashed, rerun]}

    def request(self, method: str, path: str, params: dict) -> dict:
        if path == "/v1/timeline":
            return {"now_s": 4600.0, "since_s": 1000.0, "attempts": [{"task_id": 2, "attempt": 2, **self.rerun}]}
        return {"gpus": self.series}


def test_a_daemon_window_holds_what_ran_in_it_and_leaves_unmeasured_values_out():
    api = _Api()
    record = from_server(api, 1)  # type: ignore[arg-type]
    assert record.label == "server (lug), last 1 h" and record.source == "carma server at /tmp/fake.sock"
    assert [t.id for t in record.tasks] == [2, 3]
    assert api.asked == [2]  # the timeline holds only the window's attempt; the task is asked for whole
    assert [a.outcome for a in record.task(2).attempts] == ["oom", "success"]
    assert record.ooms == ()  # the crash happened before the window
    assert record.figures["makespan_s"] is None  # task 3 has not ended
    assert record.figures["tasks_unfinished"] == 1 and record.figures["tasks_completed"] == 1
    assert record.figures["energy_mj"] is None  # GPU 1 has no energy counter
    assert record.figures["jct_mean_s"] == 2050.0 and record.figures["wait_mean_s"] == 2050.0 - 400.0 - 500.0
    assert record.series[0]["smact"] == [None, 0.5] and record.series[1]["power_w"] == [None, None]
    assert (record.start_s, record.end_s) == (1000.0, 4600.0)

    api.summaries[3].update(ended_s=2700.0, state="cancelled")
    del api.series["1"]
    record = from_server(api, 1)  # type: ignore[arg-type]
    assert record.figures["makespan_s"] == 2700.0 - 450.0 and record.figures["energy_mj"] == 1.0


def test_a_gpu_the_daemon_no_longer_has_counts_in_the_energy_and_is_not_charted():
    """A server restarted with other GPUs, or a MIG instance remade, names a GPU gone by its id: the report
    stopped with a traceback (int() of the id)."""
    api = _Api()
    api.summaries[3].update(ended_s=2700.0, state="cancelled")
    column = {"t": [1000.0, 1010.0], "used_mib": [1, 2], "smact": [0.1, 0.2], "power_w": [None, None]}
    api.series = {"0": {**column, "energy_j": [5e6, 6e6]}, "GPU-fake-0-bfaa00f6": {**column, "energy_j": [1e6, 3e6]}}
    record = from_server(api, 1)  # type: ignore[arg-type]
    assert list(record.series) == [0] and record.figures["energy_mj"] == 3.0
    assert record.source == "carma server at /tmp/fake.sock; 1 GPU it no longer has counted in the energy, not charted"
    api.series["GPU-fake-0-bfaa00f6"]["t"] = [10.0, 20.0]  # gone before the window: not in the report at all
    record = from_server(api, 1)  # type: ignore[arg-type]
    assert record.figures["energy_mj"] == 1.0 and record.source == "carma server at /tmp/fake.sock"


def test_an_early_restart_is_no_oom_crash_in_a_daemons_report():
    api = _Api()
    api.rerun = {**api.rerun, "outcome": "oom", "restarted_early": True}  # stopped before its growth crashed it
    record = from_server(api, 1)  # type: ignore[arg-type]
    assert [a.outcome for a in record.task(2).attempts] == ["oom", "restarted"]
    assert record.ooms == () and record.figures["oom_crashes"] == 0


def test_a_task_the_daemon_forgets_between_its_listing_and_its_fetch_is_left_out():
    """Its retention forgot it in between: the report stopped with "no task with id 2"."""

    class Forgetting(_Api):
        def task(self, task_id: int) -> dict:
            raise Refused(f"no task with id {task_id}: it ended and was forgotten", 404)

    record = from_server(Forgetting(), 1)  # type: ignore[arg-type]
    assert [t.id for t in record.tasks] == [3]


def test_a_daemon_windows_energy_and_series_span_its_tasks_as_a_simulations_do_across_a_counter_reset():
    api = _Api()
    api.summaries[2]["submit_s"] = 1200.0  # the window's first submission
    api.summaries[3].update(ended_s=2700.0, state="cancelled")  # its last end
    t = [1000.0, 1500.0, 2000.0, 2600.0, 3000.0]
    api.series = {"0": {"t": t, "used_mib": [1, 2, 3, 4, 5], "smact": [0.0] * 5, "power_w": [None] * 5,
                        "energy_j": [5e6, 6e6, 0.5e6, 1.5e6, 9e6]}}  # fmt: skip
    record = from_server(api, 1)  # type: ignore[arg-type]
    assert (record.start_s, record.end_s) == (1200.0, 2700.0)
    # 6 MJ at 1500 s, reset by a daemon restart before 2000 s: 0.5 MJ since it, and 1 MJ more by 2600 s
    assert record.figures["energy_mj"] == pytest.approx(0.5 + 1.0)
    assert record.series[0]["t"] == [1200.0, 1500.0, 2000.0, 2600.0]  # the step in force at 1200 s starts there
    assert record.series[0]["used_mib"] == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "not JSON"),
        ('{"runs": []}', "no carma_report_version"),
        ("[1, 2]", "no carma_report_version"),
        ('{"carma_report_version": 2, "runs": []}', "version 2 is not supported"),
        ('{"carma_report_version": 1, "runs": []}', "holds no runs"),
        ('{"carma_report_version": 1, "runs": [{"label": "x"}]}', "run 1 of the report file is malformed"),
        ('{"carma_report_version": true, "runs": []}', "version True is not supported"),
        ("[" * 100_000 + "]" * 100_000, "not JSON"),  # deeper than Python recurses: it was a RecursionError
    ],
)
def test_bad_report_files_are_refused_in_one_line(text, message):
    with pytest.raises(RecordError, match=message):
        from_json(text)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda run: run["figures"].update(makespan_s="abc"), "figures.makespan_s.float: Input should be a valid"),
        (lambda run: run["series"]["0"]["smact"].pop(), "GPU 0's smact and t differ in length (1 and 2)"),
        (lambda run: run["series"]["0"].pop("smact"), "GPU 0's series has no smact"),
        (lambda run: run["series"]["0"]["used_mib"].__setitem__(0, "x"), "series.0.used_mib.0: Input should be a"),
        (lambda run: run["tasks"][0].update(submit_s="0"), "tasks.0.submit_s: Input should be a valid number, got '0'"),
        (lambda run: run["figures"].update(energy_mj=math.inf), "figures.energy_mj holds inf, not a number"),
        (lambda run: run.update(start_s=math.nan), "the run's start_s or end_s holds nan, not a number"),
        # these three were tracebacks, after charts had been written
        (lambda run: run["gpus"][0].update(total_mib="40GB"), "gpus.0.total_mib: Input should be a valid integer"),
        (lambda run: run["gpus"][0].update(index="zero"), "gpus.0.index: Input should be a valid integer, got 'zero'"),
        (
            lambda run: run["tasks"][0].update(submit_s=None),
            "tasks.0.submit_s: Input should be a valid number, got None",
        ),
        (lambda run: run.pop("ooms"), "ooms: Field required)"),
    ],
)
def test_a_hand_edited_report_file_the_charts_cannot_draw_is_refused_in_one_line(edit, message):
    doc = json.loads(to_json([_hand_record()]))
    edit(doc["runs"][0])
    with pytest.raises(RecordError, match=f"^run 1 of the report file is malformed \\({re.escape(message)}"):
        from_json(json.dumps(doc))


# --- the page --------------------------------------------------------------------------------------------


def test_the_page_escapes_names_and_shows_what_was_not_measured(tmp_path):
    page = write_report([_hand_record()], tmp_path, ["<source>"])
    text = page.read_text()
    assert "hand &lt;made&gt;" in text and "&lt;source&gt;" in text and "a &amp; b" in text
    assert "<made>" not in text and "<source>" not in text
    row = re.search(r"<tr><td>hand &lt;made&gt;</td>(.*?)</tr>", text).group(1)
    assert re.findall(r'<td class="n">(.*?)</td>', row)[:3] == ["5.0", "–", "1"]  # 300 s; energy not measured
    assert "<th>makespan (min)</th>" in text  # "0.08" hours before
    for name in re.findall(r'<img src="([^"]+)"', text):
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC)


def test_the_completed_failed_cell_says_how_many_were_cancelled_or_not_ended(tmp_path):
    """A window of cancelled tasks showed "0 / 0", as if nothing had run in it."""
    hand = _hand_record()
    figures = {**hand.figures, "tasks_completed": 0, "tasks_failed": 0, "tasks_cancelled": 2, "tasks_unfinished": 1}
    text = write_report([replace(hand, figures=figures)], tmp_path, ["a test"]).read_text()
    row = re.search(r"<tr><td>hand &lt;made&gt;</td>(.*?)</tr>", text).group(1)
    assert re.findall(r'<td class="n">(.*?)</td>', row)[3] == "0 / 0 (2 cancelled, 1 not ended)"


def test_a_long_run_s_makespan_and_crash_times_are_in_hours_as_in_its_charts(tmp_path):
    hand = _hand_record()
    long_run = replace(
        hand,
        end_s=100.0 + 3 * 3600,
        ooms=(OomEvent(100.0 + 5400, (0,), 1),),
        figures={**hand.figures, "makespan_s": 3 * 3600},
    )
    text = write_report([long_run], tmp_path, ["a test"]).read_text()
    assert "<th>time since the run's start (h)</th>" in text and "<tr><td>1.50</td><td>0</td>" in text
    assert "<th>makespan (h)</th>" in text and '<td class="n">3.00</td>' in text


# --- through the CLI -------------------------------------------------------------------------------------


def _report(*args: object, cwd: Path | None = None, env: dict[str, str] | None = None):
    return run_carma("report", *args, cwd=cwd, env=env)


def _images(page: Path) -> list[str]:
    names = re.findall(r'<img src="([^"]+)"', page.read_text())
    for name in names:
        assert (page.parent / name).read_bytes().startswith(PNG_MAGIC), name
    return names


def test_a_report_from_saved_simulations(tmp_path):
    (tmp_path / "tiny.csv").write_text(TINY_TRACE)
    common = ("--trace", "tiny.csv", "--gpus", "1xA100-40GB")
    for policy in ("exclusive", "magm"):
        saved = run_carma("simulate", *common, "--policy", policy, "--save", f"{policy}.json", cwd=tmp_path)
        assert saved.returncode == 0, saved.stderr
        assert f"wrote {policy}.json" in saved.stdout

    result = _report("exclusive.json", "magm.json", "--out", "out", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "wrote out/report.html"
    page = tmp_path / "out" / "report.html"
    text = page.read_text()
    assert _images(page) == ["makespan_energy.png", "jct_wait_cdf.png", "timelines-1.png"]
    [magm] = from_json((tmp_path / "magm.json").read_text())
    assert magm.label == "MAGM recovery only" and magm.figures["oom_crashes"] == 1
    assert "<td>MAGM recovery only</td>" in text and "<td>Exclusive</td>" in text
    assert f'<td class="n">{magm.figures["makespan_s"] / 60:.1f}</td>' in text  # under 2 h: in minutes
    # user-given task names reach the page escaped, never as markup
    assert "&lt;script&gt;alert(&#x27;late&#x27;)&lt;/script&gt;" in text
    assert "<script>" not in text and "<b>big" not in text


def test_a_saved_sweep_keeps_every_configuration(tmp_path):
    (tmp_path / "tiny.csv").write_text(TINY_TRACE)
    saved = run_carma("simulate", "--trace", "tiny.csv", "--sweep", "--save", "sweep.json", cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr
    records = from_json((tmp_path / "sweep.json").read_text())
    assert len(records) == 16 and records[0].label == "Exclusive"  # CARMA's 15 and carma's own
    assert records[-1].label == "PAIR xMem, carma's own"
    assert all(r.source == "carma simulate, trace tiny on 3xA100-40GB (MPS)" for r in records)


def test_a_report_file_an_editor_saved_with_a_byte_order_mark_is_read(tmp_path):
    """Trace and configuration files with one were read; this one was refused as not JSON."""
    (tmp_path / "tiny.csv").write_text(TINY_TRACE)
    assert run_carma("simulate", "--trace", "tiny.csv", "--save", "a.json", cwd=tmp_path).returncode == 0
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + (tmp_path / "a.json").read_bytes())
    (tmp_path / "latin.json").write_bytes('{"label": "caf\xe9"}'.encode("latin-1"))
    assert _report("bom.json", "--out", "out", cwd=tmp_path).returncode == 0
    latin = _report("latin.json", "--out", "out", cwd=tmp_path)
    assert (latin.returncode, latin.stderr) == (
        2,
        "error: latin.json: not UTF-8 text (byte 14: invalid continuation byte)\n",
    )


def test_the_same_run_twice_gets_labels_that_say_where_each_came_from(tmp_path):
    (tmp_path / "tiny.csv").write_text(TINY_TRACE)
    assert run_carma("simulate", "--trace", "tiny.csv", "--save", "a.json", cwd=tmp_path).returncode == 0
    (tmp_path / "b.json").write_text((tmp_path / "a.json").read_text())
    assert _report("a.json", "b.json", "--out", "out", cwd=tmp_path).returncode == 0
    text = (tmp_path / "out" / "report.html").read_text()
    assert "<td>MAGM recovery only [a.json]</td>" in text and "<td>MAGM recovery only [b.json]</td>" in text
    # the same file twice: each gets its number as well
    assert _report("a.json", "a.json", "--out", "twice", cwd=tmp_path).returncode == 0
    text = (tmp_path / "twice" / "report.html").read_text()
    assert "<td>MAGM recovery only [a.json] #1</td>" in text and "<td>MAGM recovery only [a.json] #2</td>" in text


def test_a_report_from_a_daemon_on_fake_gpus(start_server, tmp_path):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "2xA100-40GB", "--time-scale", "50")
    empty = server.cli("report", "--server", "--out", tmp_path)
    assert empty.returncode == 2 and "no tasks in the last 6 h" in empty.stderr

    first = server.submit(*fakejob(300, "30000MiB"), name="first")
    second = server.submit(*fakejob(300, "30000MiB"), name="second")
    late = server.submit(*fakejob(100, "20000MiB"), name="<late> & crashed")  # fits beside neither
    assert server.cli("wait", first, second, late, "--timeout", "90").returncode == 0

    record = from_server(server.client, 1)
    assert record.label == "server (magm), last 1 h"
    assert [t.id for t in record.tasks] == [first, second, late]
    assert [a.outcome for a in record.task(late).attempts] == ["oom", "success"]
    [oom] = record.ooms
    assert oom.task_id == late and oom.t == record.task(late).attempts[0].end_s
    assert record.figures["oom_crashes"] == 1 and record.figures["tasks_completed"] == 3
    assert record.figures["makespan_s"] == pytest.approx(
        max(t.end_s for t in record.tasks) - min(t.submit_s for t in record.tasks)
    )
    assert record.figures["energy_mj"] > 0
    assert [(g.index, g.total_mib) for g in record.gpus] == [(0, 40960), (1, 40960)]
    assert set(record.series) == {0, 1}
    assert max(max(v for v in s["used_mib"] if v is not None) for s in record.series.values()) >= 29000
    assert record.start_s <= min(t.submit_s for t in record.tasks)

    result = server.cli("report", "--server", "--hours", "1", "--out", tmp_path)
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "report.html").read_text()
    assert len(_images(tmp_path / "report.html")) == 3
    assert "<td>server (magm), last 1 h</td>" in text
    assert "&lt;late&gt; &amp; crashed" in text and "<late>" not in text

    # a saved simulation beside the daemon, in the given order
    (tmp_path / "tiny.csv").write_text(TINY_TRACE)
    saved = run_carma("simulate", "--trace", "tiny.csv", "--save", "tiny.json", cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr
    both = server.cli("report", tmp_path / "tiny.json", "--server", "--hours", "1", "--out", tmp_path / "both")
    assert both.returncode == 0, both.stderr
    text = (tmp_path / "both" / "report.html").read_text()
    assert text.index("<td>MAGM recovery only</td>") < text.index("<td>server (magm), last 1 h</td>")
    assert f"{tmp_path / 'tiny.json'}: 1 run, carma simulate, trace tiny on 3xA100-40GB (MPS)" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "nothing to report"),
        (("missing.json",), "missing.json: no such file"),
        (("notes.txt",), "notes.txt: not a carma report file (not JSON)"),
        (("other.json",), "other.json: not a carma report file (no carma_report_version"),
        (("future.json",), "future.json: report format version 9 is not supported"),
        (("--server",), "the carma server is not running"),
        (("--server", "--hours", "0"), "--hours must be more than 0"),
        (
            ("notes.txt", "--hours", "1"),
            "--hours is the window of --server's history: give --server too",
        ),  # was ignored
    ],
)
def test_report_mistakes_are_one_line_and_status_2(tmp_path, args, message):
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "other.json").write_text('{"trace": "carma-t1", "runs": []}')
    (tmp_path / "future.json").write_text('{"carma_report_version": 9, "runs": []}')
    result = _report(*args, "--out", "out", cwd=tmp_path, env=cli_env(CARMA_HOME=str(tmp_path / "home")))
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
    assert not (tmp_path / "out" / "report.html").exists()


def test_an_out_that_is_a_file_is_refused_and_left_alone(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    result = _report("--server", "--out", "notes.txt", cwd=tmp_path)
    assert (result.returncode, result.stderr) == (2, "error: --out notes.txt is a file; give a directory\n")
    assert (tmp_path / "notes.txt").read_text() == "hello"


def test_a_chart_legend_of_long_labels_stays_clear_of_the_title():
    """The legend sat at the figure's top right, on the title's line: long run labels ran into the title."""
    pytest.importorskip("matplotlib")
    from carma.reports import plots

    plt = plots.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), layout="constrained")
    lines = [axes[0].plot([0, 1], [0, i])[0] for i in range(15)]
    plots._legend(fig, lines, [f"configuration {i} with a much longer label text than usual" for i in range(15)])
    title = fig.suptitle("CDF of job completion time and waiting time (queued, recovery queue included), done")
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(renderer)
    assert not legend.overlaps(title.get_window_extent(renderer))
    plt.close(fig)


def test_the_timeline_chart_shows_the_gpus_that_ran_tasks_not_every_idle_one(tmp_path):
    """A 300-GPU server drew a row per GPU (76,076 px, five minutes) for a trace that used a few."""
    pytest.importorskip("matplotlib")
    from carma.reports.plots import plot_timelines
    from carma.sim.experiment import TwinConfig
    from carma.sim.gpus import parse_gpus

    four = Trace("four", load_trace("carma-t1", load_catalog()).entries[:4])
    heights = []
    for gpus in ("4xA100-40GB", "40xA100-40GB"):
        record = from_run_result(simulate(four, RunConfig("magm"), TwinConfig(gpus=parse_gpus(gpus))))
        png = plot_timelines([record], tmp_path / f"{gpus}.png").read_bytes()
        heights.append(int.from_bytes(png[20:24], "big"))  # the PNG header's height
    assert heights[0] == heights[1]
    task = record.tasks[0]  # a server's GPU gone since is named by its id: drawn without a row, no TypeError
    gone = replace(task, attempts=(replace(task.attempts[0], gpus=("GPU-gone",)),))  # type: ignore[arg-type]
    plot_timelines([replace(record, tasks=(gone, *record.tasks[1:]))], tmp_path / "gone.png")
