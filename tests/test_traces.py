"""Trace loading: built-in traces, CARMA trace scripts, carma's CSV and YAML formats, and their errors."""

from __future__ import annotations

import csv
import dataclasses
import os

import pytest

from carma.traces.catalog import Catalog, data_file, load_catalog
from carma.traces.loaders import TraceError, load_trace


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return load_catalog()


@pytest.fixture
def write(tmp_path):
    """Write a trace file under tmp_path and return its path as a string (what --trace receives)."""

    def _write(name: str, text: str) -> str:
        path = tmp_path / name
        path.write_text(text)
        return str(path)

    return _write


def schedule(trace) -> list[tuple[float, str]]:
    return [(e.submit_s, e.workload.name) for e in trace.entries]


# --- built-in traces ---------------------------------------------------------------------------------


def test_carma_t1_has_60_entries_sorted_by_submit_time(catalog):
    trace = load_trace("carma-t1", catalog)
    assert trace.name == "carma-t1"
    assert len(trace.entries) == 60
    times = [e.submit_s for e in trace.entries]
    assert times == sorted(times)
    assert schedule(trace)[0] == (0.0, "Xception")
    assert trace.skipped == ()


def test_carma_t1_entries_are_the_packaged_rows_with_catalog_workloads(catalog):
    with open(data_file("t1.csv"), newline="") as f:
        rows = [(float(r["submit_s"]), r["task"]) for r in csv.DictReader(f)]
    trace = load_trace("carma-t1", catalog)
    assert schedule(trace) == rows
    assert all(e.workload == catalog[e.workload.name] for e in trace.entries)


@pytest.mark.parametrize(
    ("ref", "file", "line"), [("carma-heavy60", "heavy60.csv", 4), ("carma-mix90", "mix90.csv", 57)]
)
def test_builtin_trace_with_an_unknown_task_names_file_line_and_task(catalog, ref, file, line):
    with pytest.raises(TraceError) as excinfo:
        load_trace(ref, catalog)
    assert str(excinfo.value) == (
        f"{ref} ({file}), line {line}: unknown task 'mnist_train': it is not in the workload catalog "
        "(use --skip-unknown to leave it out)"
    )


@pytest.mark.parametrize(
    ("ref", "kept", "skipped", "summary"),
    [("carma-heavy60", 53, 7, "mnist_train (x7)"), ("carma-mix90", 89, 1, "mnist_train")],
)
def test_skip_unknown_leaves_out_and_reports_unknown_entries(catalog, ref, kept, skipped, summary):
    trace = load_trace(ref, catalog, skip_unknown=True)
    assert len(trace.entries) == kept
    assert trace.skipped == ("mnist_train",) * skipped
    assert trace.skipped_summary() == summary
    assert "mnist_train" not in {e.workload.name for e in trace.entries}


def test_skipped_summary_counts_each_name(catalog, write):
    path = write("t.csv", "submit_s,task\n0,vgg\n1,foo\n2,bar\n3,foo\n")
    trace = load_trace(path, catalog, skip_unknown=True)
    assert schedule(trace) == [(0.0, "vgg")]
    assert trace.skipped_summary() == "bar, foo (x2)"


# --- CARMA trace scripts -----------------------------------------------------------------------------

SCRIPT = """\
#!/bin/bash
# CARMA trace
python /x/src/submit.py --task /x/workloads/Xception.rad
sleep 181

python /x/src/submit.py --task /x/workloads/vgg.rad
python3 /x/src/submit.py --task /x/workloads/dlrm.rad &
sleep 29.5
sleep 10
python /x/src/submit.py --task /x/workloads/xlnet_base_cased_2.rad
"""
SCRIPT_AS_CSV = "submit_s,task\n0,Xception\n181,vgg\n181,dlrm\n220.5,xlnet_base_cased_2\n"


def test_trace_script_submit_times_are_cumulative_sleeps(catalog, write):
    trace = load_trace(write("trace1.sh", SCRIPT), catalog)
    assert trace.name == "trace1"
    assert schedule(trace) == [(0.0, "Xception"), (181.0, "vgg"), (181.0, "dlrm"), (220.5, "xlnet_base_cased_2")]


def test_trace_script_equals_the_csv_of_the_same_content(catalog, write):
    script = load_trace(write("same.sh", SCRIPT), catalog)
    table = load_trace(write("same.csv", SCRIPT_AS_CSV), catalog)
    assert script == table


def test_trace_script_comments_begin_a_word_as_in_the_shell(catalog, write):
    catalog = catalog.with_workloads({"vgg#2": dataclasses.replace(catalog["vgg"], name="vgg#2")})
    script = (
        "python submit.py --task /x/vgg#2.rad  # a '#' inside a word is part of it\n"
        "sleep 10;# a comment right after ';'\n"
        "python submit.py --task '/x/#1/dlrm.rad' #the quoted '#' is in the path\n"
        "sleep 5 # sleep 100\n"
        "python submit.py --task /x/Xception.rad\n"
    )
    trace = load_trace(write("hash.sh", script), catalog)
    assert schedule(trace) == [(0.0, "vgg#2"), (10.0, "dlrm"), (15.0, "Xception")]


def test_a_submit_commands_task_may_follow_an_equals_sign(catalog, write):
    """`--task=PATH` is what argparse takes too."""
    trace = load_trace(
        write("eq.sh", "python submit.py --task=/x/vgg.rad\nsleep 5\nsubmit.py --task /x/dlrm.rad\n"), catalog
    )
    assert schedule(trace) == [(0.0, "vgg"), (5.0, "dlrm")]


def test_a_json_trace_is_read_as_the_yaml_it_also_is(catalog, write):
    """It was read as a trace script and refused with its quotes stripped."""
    trace = load_trace(
        write("t.json", '{"name": "j", "tasks": [{"at": 0, "task": "vgg"}, {"at": 5, "task": "dlrm"}]}'), catalog
    )
    assert (trace.name, schedule(trace)) == ("j", [(0.0, "vgg"), (5.0, "dlrm")])


def test_a_file_without_a_known_suffix_is_read_as_a_script(catalog, write):
    assert schedule(load_trace(write("trace1", SCRIPT), catalog))[0] == (0.0, "Xception")


# --- carma's CSV format ------------------------------------------------------------------------------


def test_csv_override_columns_change_only_their_rows(catalog, write):
    path = write(
        "o.csv",
        "submit_s,task,mem_mib,solo_s,gpus,smact\n20,vgg,18GiB,,,\n0,vgg,,,,\n30,mytask,4096,600,2,0.9\n",
    )
    trace = load_trace(path, catalog)
    plain, big, mine = (e.workload for e in trace.entries)
    assert [e.submit_s for e in trace.entries] == [0.0, 20.0, 30.0]
    assert plain == catalog["vgg"]
    assert big == dataclasses.replace(catalog["vgg"], mem_mib=18 * 1024)
    assert (mine.name, mine.gpus, mine.solo_s, mine.mem_mib, mine.smact) == ("mytask", 2, 600.0, 4096, 0.9)
    assert mine.ttfk_s == catalog.typical_profile()["ttfk_s"]


def test_a_task_a_csv_row_defines_is_named_alone_by_the_rows_below(catalog, write):
    """The row below said "unknown task 'my_job'", and --skip-unknown dropped a task the file defined."""
    trace = load_trace(write("r.csv", "submit_s,task,solo_s,mem_mib\n0,my_job,1800,6000\n60,my_job,,\n"), catalog)
    first, second = (e.workload for e in trace.entries)
    assert second == first and (first.solo_s, first.mem_mib) == (1800.0, 6000)


def test_a_row_gives_its_own_values_of_a_task_a_row_above_defined(catalog, write):
    """As it may a catalog task's; it said "unknown task 'my_job'", and a row naming the task without the
    commas of the empty columns was refused (fewer values than the header)."""
    rows = "submit_s,task,gpus,solo_s,mem_mib\n0,my_job,1,1800,6000\n10,my_job,2,,\n20,my_job,,3600\n30,my_job\n"
    first, wider, longer, alone = (e.workload for e in load_trace(write("r.csv", rows), catalog).entries)
    assert (first.gpus, first.solo_s, first.mem_mib) == (1, 1800.0, 6000)
    assert wider == dataclasses.replace(first, gpus=2) and longer == dataclasses.replace(first, solo_s=3600.0)
    assert (
        alone == first
    )  # the first row defines it; the values a row below gives are that entry's, as a catalog task's


def test_a_short_new_task_is_told_to_give_its_own_start_up_times(catalog, write):
    """It failed on the catalog's typical time to first kernel and warm-up, values the user never wrote."""
    typical = catalog.typical_profile()
    with pytest.raises(TraceError) as excinfo:
        load_trace(write("s.csv", "submit_s,task,solo_s,mem_mib\n0,short,10,1000\n"), catalog)
    assert str(excinfo.value) == (
        f"s.csv, line 2: task 'short': a task of 10 s needs its own ttfk_s and warmup_s: the catalog's "
        f"({typical['ttfk_s']:g} s and {typical['warmup_s']:g} s) do not end before it"
    )
    trace = load_trace(write("s.csv", "submit_s,task,solo_s,mem_mib,ttfk_s,warmup_s\n0,short,10,1000,2,1\n"), catalog)
    assert trace.entries[0].workload.solo_s == 10


def test_csv_rows_with_equal_times_keep_file_order(catalog, write):
    trace = load_trace(write("tie.csv", "submit_s,task\n5,vgg\n5,dlrm\n0,Xception\n5,vgg2\n"), catalog)
    assert schedule(trace) == [(0.0, "Xception"), (5.0, "vgg"), (5.0, "dlrm"), (5.0, "vgg2")]


def test_csv_new_task_without_solo_time_is_an_error(catalog, write):
    with pytest.raises(TraceError) as excinfo:
        load_trace(write("n.csv", "submit_s,task,mem_mib\n0,mytask,4GiB\n"), catalog)
    assert str(excinfo.value) == (  # no hint at --skip-unknown, which does not skip a row defining a task
        "n.csv, line 2: unknown task 'mytask': not in the workload catalog; define it with solo_s"
    )


# --- YAML format -------------------------------------------------------------------------------------

YAML_TRACE = """\
name: my-experiment
workloads:
  big: {solo_s: 1200, mem_mib: 18GiB, smact: 0.5}
  vgg: {mem_mib: 8000}
tasks:
  - {at: 0, task: big}
  - {at: 30, task: vgg, repeat: 3, every: 60}
  - at: 45
    task: Xception
"""


def test_yaml_trace_with_definitions_repeats_and_a_name(catalog, write):
    trace = load_trace(write("exp.yaml", YAML_TRACE), catalog)
    assert trace.name == "my-experiment"
    assert schedule(trace) == [(0.0, "big"), (30.0, "vgg"), (45.0, "Xception"), (90.0, "vgg"), (150.0, "vgg")]
    big = trace.entries[0].workload
    assert (big.solo_s, big.mem_mib, big.smact, big.gpus) == (1200.0, 18 * 1024, 0.5, 1)
    assert big.drama == catalog.typical_profile()["drama"]
    vggs = [e.workload for e in trace.entries if e.workload.name == "vgg"]
    assert vggs == [dataclasses.replace(catalog["vgg"], mem_mib=8000)] * 3


def test_a_yaml_definition_of_a_new_task_without_fields_says_what_it_needs(catalog, write):
    """It said "unknown task 'newt': it is not in the workload catalog", of the task it defines."""
    with pytest.raises(TraceError) as excinfo:
        load_trace(write("w.yaml", "workloads: {newt: null}\ntasks: [{at: 0, task: newt}]\n"), catalog)
    assert str(excinfo.value) == "w.yaml, workloads: task 'newt' gives no fields: define it with solo_s and mem_mib"


def test_yaml_definitions_take_the_catalogs_typical_profile_not_each_others(catalog, write):
    """Each definition joined the catalog before the next was made, so a new task's defaults were the median
    of the catalog and the tasks defined above it: the order of `workloads:` changed them, unlike the CSV's."""
    fast = "\n".join(f"  fast{i}: {{solo_s: 600, mem_mib: 1000, smact: 1.0, ttfk_s: 1}}" for i in range(40))
    text = f"workloads:\n{fast}\n  plain: {{solo_s: 600, mem_mib: 1000}}\ntasks:\n  - {{at: 0, task: plain}}\n"
    [entry] = load_trace(write("w.yaml", text), catalog).entries
    typical = catalog.typical_profile()
    assert (entry.workload.smact, entry.workload.ttfk_s) == (typical["smact"], typical["ttfk_s"])


def test_yaml_trace_without_a_name_is_named_after_the_file(catalog, write):
    trace = load_trace(write("short.yml", "tasks:\n  - {at: 10, task: vgg, repeat: 2}\n"), catalog)
    assert trace.name == "short"
    assert schedule(trace) == [(10.0, "vgg"), (10.0, "vgg")]  # `every` defaults to 0
    spaced = load_trace(write("spaced.yml", "tasks:\n  - {at: 1e1, task: vgg, repeat: 2, every: 6e1}\n"), catalog)
    assert schedule(spaced) == [(10.0, "vgg"), (70.0, "vgg")]  # numbers YAML 1.1 reads as text, read alike


def test_yaml_unknown_task_can_be_skipped(catalog, write):
    path = write("s.yaml", "tasks:\n  - {at: 0, task: vgg}\n  - {at: 5, task: mnist_train, repeat: 2}\n")
    trace = load_trace(path, catalog, skip_unknown=True)
    assert schedule(trace) == [(0.0, "vgg")]
    assert trace.skipped_summary() == "mnist_train (x2)"


# --- errors ------------------------------------------------------------------------------------------

BAD_TRACES = [
    pytest.param("t.csv", "submit_s,task\n-5,vgg\n", "line 2: submit time must not be negative", id="negative-time"),
    pytest.param(  # nanoseconds since the epoch: the twin's clock rounded every time to 256 s
        "t.csv",
        "submit_s,task\n1700000000000000000,vgg\n",
        "line 2: submit time 1.7e+18 s is over 1e+10 s (317 years): give it in seconds, not milliseconds or",
        id="time-in-ns",
    ),
    pytest.param(  # it read "submit time 1e+10 s is over 1e+10 s"
        "t.sh",
        "sleep 1e10\nsleep 1\npython submit.py --task vgg.rad\n",
        "submit time 10000000001 s is over",
        id="just-over",
    ),
    pytest.param(
        "t.csv",
        "submit_s,task,solo_s,mem_mib\n0,mine,1e30,8000\n",
        "line 2: task 'mine': solo time 1e+30 s is over 1e+10 s (317 years): give it in seconds",
        id="solo-too-long",
    ),
    pytest.param("t.csv", "submit_s,task\nsoon,vgg\n", "line 2: submit time 'soon' is not a number", id="bad-time"),
    pytest.param("t.csv", "time,task\n0,vgg\n", "needs the columns submit_s and task", id="missing-column"),
    pytest.param("t.csv", "", "needs the columns submit_s and task", id="empty-csv"),
    pytest.param("t.csv", "submit_s,task\n", "the trace has no tasks", id="no-tasks"),
    pytest.param(
        "t.csv", "submit_s,task,colour\n0,vgg,red\n", "line 2: task 'vgg': unknown field(s) colour", id="unknown-column"
    ),
    pytest.param(
        "t.csv", "submit_s,task,mem_mib\n0,vgg,lots\n", "mem_mib: cannot read 'lots' as a memory size", id="bad-mem"
    ),
    pytest.param("t.csv", "submit_s,task,gpus\n0,vgg,0\n", "gpus must be at least 1", id="bad-override"),
    pytest.param(
        "t.sh",
        "sleep 5\nsubmit vgg\n",
        "line 2: expected 'sleep N' or a submit.py --task command, not 'submit vgg'",
        id="bad-line",
    ),
    pytest.param(
        "t.sh",
        "python submit.py --task vgg.rad | tee log\n",
        "line 1: '|': a trace script takes commands joined by",
        id="pipe",
    ),
    pytest.param("t.sh", "python submit.py --task 'vgg.rad\n", "line 1: No closing quotation", id="open-quote"),
    pytest.param("t.sh", "sleep 5 & && python s.py --task vgg.rad\n", "a command is missing before '&&'", id="and"),
    pytest.param("t.sh", "& python s.py --task vgg.rad\n", "line 1: a command is missing before '&'", id="lead"),
    pytest.param("t.sh", "; python s.py --task vgg.rad\n", "line 1: a command is missing before ';'", id="lead-semi"),
    pytest.param("t.sh", "sleep 1 ; ; python s.py --task vgg.rad\n", "missing before ';'", id="semi-semi"),
    pytest.param("t.sh", "sleep 1\nsleep 10 &&\n", "line 2: a command is missing after '&&'", id="and-at-end"),
    pytest.param("t.txt", "submit_s,task\n0,vgg\n", "when its name ends in .csv)", id="csv-named-txt"),
    pytest.param(
        "t.yaml",
        "tasks:\n  - {at: 0, task: vgg, repeat: 100000000}\n",
        "task 1: a trace holds at most 100000 tasks",
        id="huge",
    ),
    pytest.param("t.txt", "tasks:\n  - {at: 0, task: vgg}\n", "ends in .yaml or .yml)", id="yaml-named-txt"),
    pytest.param("t.csv", "submit_s,task, task\n0,vgg,x\n", "the header names column(s) 'task' twice", id="dup-column"),
    pytest.param("t.sh", "sleep soon\n", "line 1: cannot read 'sleep soon'", id="bad-sleep"),
    pytest.param("t.sh", "sleep -5\npython submit.py --task vgg.rad\n", "must not be negative", id="negative-sleep"),
    pytest.param("t.sh", "# nothing\n", "the trace has no tasks", id="empty-script"),
    pytest.param(
        "t.sh", "sleep 100\nsleep -10\npython submit.py --task vgg.rad\n", "line 2: 'sleep -10'", id="sleep-back"
    ),
    *(
        pytest.param(
            "t.sh",
            f"sleep {word}\npython submit.py --task vgg.rad\n",
            "must not be negative or infinite",
            id=f"sleep-{word}",
        )
        for word in ("inf", "nan")
    ),
    *(
        pytest.param(
            "t.csv", f"submit_s,task\n{word},vgg\n", "line 2: submit time must be a finite number", id=f"csv-{word}"
        )
        for word in ("inf", "nan")
    ),
    pytest.param("t.csv", "submit_s,task,ttfk_s\n0,vgg,nan\n", "ttfk_s must be a finite number", id="nan-field"),
    pytest.param("t.csv", "submit_s,task,gpus\n0,vgg,1.5\n", "gpus must be a whole number", id="fractional-gpus"),
    pytest.param("t.csv", "submit_s,task\n0,vgg\n5\n", "t.csv, line 3: no task name", id="short-row"),
    pytest.param("t.csv", "submit_s,task\n0,vgg\n5, \n", "t.csv, line 3: no task name", id="no-name"),
    pytest.param(
        "t.csv", "submit_s,task\n0,vgg\n\n\n5,nosuch\n", "line 5: unknown task 'nosuch'", id="line-after-blanks"
    ),
    pytest.param(
        "t.csv",
        'submit_s,task,mem_mib\n0,vgg,"8\nGiB"\n5,nosuch,\n',
        "lines 2-3: a quoted value holds",
        id="quoted-newline",
    ),
    pytest.param("t.yaml", "tasks:\n  - {at: .inf, task: vgg}\n", "task 1: submit time must be a finite", id="at-inf"),
    pytest.param("t.yaml", "tasks:\n  - {at: true, task: vgg}\n", "task 1: 'at' must be a number", id="at-bool"),
    pytest.param(
        "t.yaml", "tasks:\n  - {at: 0, task: vgg, repeat: 2, every: .nan}\n", "'every' must be a finite", id="every-nan"
    ),
    pytest.param("t.yaml", "nmae: x\ntasks:\n  - {at: 0, task: vgg}\n", ": unknown key(s) nmae", id="top-key"),
    pytest.param("t.yaml", "name: [a]\ntasks:\n  - {at: 0, task: vgg}\n", "'name' must be a string", id="name"),
    pytest.param("t.yaml", "tasks: [\n", "not valid YAML", id="invalid-yaml"),
    pytest.param(  # the second `tasks:` silently replaced the first
        "t.yaml",
        "tasks:\n  - {at: 0, task: resnet}\ntasks:\n  - {at: 0, task: vgg}\n",
        "t.yaml: not valid YAML (line 3: key 'tasks' given twice in one mapping)",
        id="duplicate-key",
    ),
    pytest.param("t.yaml", "tasks:\n  - {at: 0, task: vgg, at: 100}\n", "line 2: key 'at' given twice", id="dup-at"),
    pytest.param(  # was 90 s, where CSV refuses it
        "t.yaml", "tasks:\n  - {at: 1:30, task: vgg}\n", "line 2: 1:30 is YAML 1.1's base-60 for 90", id="base-60"
    ),
    pytest.param(
        "t.yaml", "tasks:\n  - {at: 0, task: null}\n", "task 1: 'task' must be a task name, not None", id="null"
    ),
    pytest.param("t.yaml", "", "a YAML trace needs a 'tasks' list", id="empty-yaml"),
    pytest.param("t.yaml", "tasks: []\n", "the trace has no tasks", id="no-yaml-tasks"),
    pytest.param("t.yaml", "tasks:\n  - {task: vgg}\n", "task 1: each task needs 'at'", id="missing-at"),
    pytest.param("t.yaml", "tasks:\n  - {at: soon, task: vgg}\n", "task 1: 'at' must be a number", id="bad-at"),
    pytest.param("t.yaml", "tasks:\n  - {at: -1, task: vgg}\n", "must not be negative", id="negative-at"),
    pytest.param(
        "t.yaml", "workloads: [vgg]\ntasks:\n  - {at: 0, task: vgg}\n", "'workloads' must map", id="list-defs"
    ),
    pytest.param("t.csv", "submit_s;task\n0;vgg\n", "(its header is separated by ';':", id="semicolons"),
    pytest.param("t.tsv", "submit_s\ttask\n0\tvgg\n", "line 1: this looks like a CSV trace", id="tsv"),
    pytest.param(  # an empty list was taken for no definitions
        "t.yaml", "workloads: []\ntasks:\n  - {at: 0, task: vgg}\n", "'workloads' must map", id="empty-list-defs"
    ),
    pytest.param(
        "t.yaml",
        "workloads:\n  vgg: {memory: 8GiB}\ntasks:\n  - {at: 0, task: vgg}\n",
        "workloads: task 'vgg': unknown field(s) memory",
        id="unknown-definition-field",
    ),
    pytest.param(
        "t.yaml",
        "workloads:\n  big: {solo_s: 60, mem_mib: 0}\ntasks:\n  - {at: 0, task: big}\n",
        "workloads: task 'big': mem_mib: memory size must be positive",
        id="zero-mem",
    ),
    pytest.param(
        "t.yaml",
        "workloads:\n  big: {solo_s: 60, mem_mib: 900, mem_first_mib: 0}\ntasks:\n  - {at: 0, task: big}\n",
        "workloads: task 'big': mem_first_mib: memory size must be positive and finite, got 0",
        id="zero-first-mem",
    ),
    *(
        pytest.param(
            "t.yaml", f"tasks:\n  - {{at: 0, task: vgg, {item}}}\n", f"task 1: {message}", id=f"bad-repeat-{item}"
        )
        for item, message in [
            ("repeat: 0", "'repeat' must be a positive integer"),
            ("repeat: 2.5", "'repeat' must be a positive integer"),
            ("repeat: many", "'repeat' must be a positive integer"),
            ("repeat: 2, every: -1", "'every' must be a finite number of seconds >= 0"),
            ("repeat: 2, every: often", "'every' must be a number of seconds"),
            ("every: 60", "'every' spaces a task's repeats: give 'repeat' too"),  # it was ignored
            # YAML 1.1 reads 1e300 as text, which 'every' refused as not finite, where 'at' reads it as a number
            ("repeat: 2, every: 1e300", "submit time 1e+300 s is over 1e+10 s"),
        ]
    ),
]


def test_one_skipped_entry_is_an_entry(catalog, write):
    trace = load_trace(write("t.csv", "submit_s,task\n0,vgg\n5,foo\n"), catalog, skip_unknown=True)
    assert trace.skipped_note() == "skipped 1 entry of unknown tasks: foo"


def test_a_trace_of_unknown_tasks_only_says_what_was_left_out(catalog, write):
    with pytest.raises(TraceError) as excinfo:
        load_trace(write("t.csv", "submit_s,task\n0,mnist_train\n5,foo\n5,foo\n"), catalog, skip_unknown=True)
    assert str(excinfo.value) == (
        "t.csv: the trace has no tasks once its 3 entries of unknown tasks are left out: foo (x2), mnist_train"
    )


@pytest.mark.parametrize(("file", "text", "message"), BAD_TRACES)
def test_a_bad_trace_is_one_clear_trace_error(catalog, write, file, text, message):
    with pytest.raises(TraceError) as excinfo:
        load_trace(write(file, text), catalog)
    error = str(excinfo.value)
    assert error.startswith(f"{file}")
    assert message in error
    assert "\n" not in error


def test_a_trace_that_is_not_utf8_is_a_trace_error_naming_the_file(catalog, tmp_path):
    path = tmp_path / "latin.csv"
    path.write_bytes("submit_s,task\n0,caf\xe9\n".encode("latin-1"))
    with pytest.raises(TraceError, match=r"^latin\.csv: not UTF-8 text \(byte 19"):
        load_trace(str(path), catalog)


def test_a_spreadsheets_csv_with_a_byte_order_mark_and_crlf_reads_as_plain_csv(catalog, tmp_path):
    path = tmp_path / "excel.csv"
    path.write_bytes(b"\xef\xbb\xbfsubmit_s,task\r\n0,vgg\r\n5,dlrm\r\n")
    assert schedule(load_trace(str(path), catalog)) == [(0.0, "vgg"), (5.0, "dlrm")]


def test_a_csv_with_bare_carriage_returns_reads_as_lines(catalog, tmp_path):
    """A spreadsheet's "CSV (Macintosh)": it was a traceback (`new-line character seen in unquoted field`)."""
    path = tmp_path / "mac.csv"
    path.write_bytes(b"submit_s,task\r0,vgg\r5,dlrm\r")
    assert schedule(load_trace(str(path), catalog)) == [(0.0, "vgg"), (5.0, "dlrm")]


@pytest.mark.parametrize(
    ("rows", "error"),
    [
        (['0,"vgg', *(f"{60 * i},vgg" for i in range(1, 100))], r"lines 2-101: a quoted value holds a line break"),
        (['0,"vg', 'g"', "60,vgg"], r"lines 2-3: a quoted value holds a line break"),
        (["0,vgg", '60,"dlrm'], r"line 3: a quoted value holds a line break \(a quote left open\?\)$"),
        # the rest of the file read as one value passes the csv module's limit: it was a traceback
        (
            ['0,"vgg', *(f"{60 * i},vgg" for i in range(1, 20_000))],
            r"line 2: field larger than field limit .* open\?\)$",
        ),
    ],
)
def test_a_quote_left_open_in_a_csv_is_an_error_where_it_opens(catalog, write, rows, error):
    """It read the rest of the file as a task's name (`line 101: unknown task 'vgg\\n60,vgg...'`)."""
    with pytest.raises(TraceError, match=rf"^open\.csv, {error}"):
        load_trace(write("open.csv", "\n".join(["submit_s,task", *rows]) + "\n"), catalog)


def test_a_row_that_defines_a_task_too_thinly_is_an_error_even_when_skipping(catalog, write):
    path = write("thin.csv", "submit_s,task,solo_s,mem_mib\n0,vgg,,\n10,my_job,,6000\n20,mnist_train,,\n")
    with pytest.raises(TraceError, match=r"line 3: unknown task 'my_job': .*define it with solo_s$"):
        load_trace(path, catalog, skip_unknown=True)
    trace = load_trace(write("named.csv", "submit_s,task\n0,vgg\n20,mnist_train\n"), catalog, skip_unknown=True)
    assert trace.skipped == ("mnist_train",)  # a bare unknown name is still skipped


def test_csv_header_names_may_have_spaces_after_the_commas(catalog, write):
    """`submit_s, task, mem_mib` was 'unknown field(s) mem_mib' (its space hidden) or lacked its columns."""
    trace = load_trace(write("s.csv", "submit_s, task, mem_mib\n0,vgg,8GiB\n"), catalog)
    assert schedule(trace) == [(0.0, "vgg")] and trace.entries[0].workload.mem_mib == 8192


def test_script_lines_split_into_commands_as_the_shell_does(catalog, write):
    """`sleep 3600; python submit.py ...` submitted at the sleep's start, and two submissions on a line
    were one unknown task named 'a.rad;'."""
    script = (
        "python /x/submit.py --task /x/resnet.rad\n"
        "sleep 3600; python /x/submit.py --task /x/vgg.rad  # the second\n"
        "sleep 1m && python /x/submit.py --task /x/vgg.rad &\n"
        "python /x/submit.py --task /x/resnet.rad; python /x/submit.py --task /x/dlrm.rad\n"
    )
    assert schedule(load_trace(write("s.sh", script), catalog)) == [
        (0.0, "resnet"),
        (3600.0, "vgg"),
        (3600.0, "resnet"),  # the line before went to the background: its sleep delays only its own vgg
        (3600.0, "dlrm"),
        (3660.0, "vgg"),
    ]


def test_script_lines_go_on_on_the_next_as_the_shell_reads_them(catalog, write):
    """A line ending in a backslash or in `&&` goes on on the next: it was "No escaped character", or "a
    command is missing after '&&'"; a comment's backslash continues nothing."""
    script = (
        "sleep 10 && \\\n  python /x/submit.py \\\n  --task /x/vgg.rad &\n"
        "sleep 20 &&  # then\npython /x/submit.py --task /x/resnet.rad\n"
        "sleep 5  # 5 s \\\n"
        "python /x/submit.py --task /x/dlrm.rad\n"
    )
    trace = load_trace(write("c.sh", script), catalog)
    assert schedule(trace) == [(10.0, "vgg"), (20.0, "resnet"), (25.0, "dlrm")]
    assert [e.where for e in trace.entries] == ["c.sh, line 1", "c.sh, line 4", "c.sh, line 7"]


def test_a_sleep_sent_to_the_background_delays_nothing_else(catalog, write):
    """As the shell runs it: `sleep 600 &` returns at once, and `a & b` starts b beside a."""
    script = (
        "sleep 600 &\n"
        "python /x/submit.py --task /x/resnet.rad\n"
        "sleep 60 && python /x/submit.py --task /x/vgg.rad & sleep 5; python /x/submit.py --task /x/dlrm.rad\n"
    )
    assert schedule(load_trace(write("b.sh", script), catalog)) == [(0.0, "resnet"), (5.0, "dlrm"), (60.0, "vgg")]


def test_script_sleeps_take_coreutils_units_and_task_paths_may_be_quoted(catalog, write):
    script = "sleep 2m\npython submit.py --task '/x/vgg.rad'\nsleep 1.5h\npython submit.py --task \"/x/dlrm.rad\"\n"
    assert schedule(load_trace(write("u.sh", script), catalog)) == [(120.0, "vgg"), (5520.0, "dlrm")]


def test_a_script_sleep_of_several_arguments_sleeps_their_sum_as_coreutils_does(catalog, write):
    script = "sleep 1m 30\npython submit.py --task /x/vgg.rad\n"  # was an error
    assert schedule(load_trace(write("s.sh", script), catalog)) == [(90.0, "vgg")]


def test_a_trace_may_give_its_tasks_estimates_for_the_estimator_runs(catalog, write):
    path = write(
        "est.csv", "submit_s,task,solo_s,mem_mib,horus_mib,gpumemnet_mib\n0,my_job,600,4000,5GiB,\n5,vgg,,,,9000\n"
    )
    mine, vgg = (e.workload for e in load_trace(path, catalog).entries)
    assert mine.estimates == {"horus": 5 * 1024}
    assert vgg.estimates == {**catalog["vgg"].estimates, "gpumemnet": 9000}  # the catalog's others kept


def test_invalid_yaml_is_a_trace_error_naming_the_file(catalog, write):
    with pytest.raises(TraceError, match=r"^t\.yaml: not valid YAML \(") as excinfo:
        load_trace(write("t.yaml", "tasks: [\n"), catalog)
    assert isinstance(excinfo.value, ValueError)  # the CLI reports every ValueError as a usage error


def test_missing_trace_file_lists_the_builtin_traces(catalog, tmp_path):
    missing = tmp_path / "nope.csv"
    with pytest.raises(TraceError) as excinfo:
        load_trace(str(missing), catalog)
    builtin = "carma-t1, carma-t2, carma-heavy60, carma-mix90"
    assert str(excinfo.value) == f"no trace file {str(missing)!r} (built-in traces: {builtin})"


def test_a_trace_that_is_no_file_is_told_what_to_give(catalog, tmp_path):
    """A pipe (`--trace <(...)`) was "no trace file '/dev/fd/63'", and `--trace ''` "trace '' is a directory"."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(TraceError) as excinfo:
        load_trace(str(fifo), catalog)
    assert str(excinfo.value) == (
        f"trace {str(fifo)!r} is not a regular file: save the trace to a file (.csv, .yaml or a script)"
    )
    with pytest.raises(TraceError, match=r"^no trace file '' "):
        load_trace("", catalog)


def test_a_directory_given_as_trace_is_named_as_one(catalog, tmp_path):
    with pytest.raises(TraceError) as excinfo:
        load_trace(str(tmp_path), catalog)
    assert str(excinfo.value) == f"trace {str(tmp_path)!r} is a directory: give a trace file in it"


def test_a_csv_row_with_more_values_than_columns_is_a_trace_error(catalog, write):
    with pytest.raises(TraceError, match="line 2"):
        load_trace(write("t.csv", "submit_s,task\n0,vgg,extra\n"), catalog)


def test_a_yaml_task_with_an_unknown_key_is_an_error(catalog, write):
    with pytest.raises(TraceError, match="repeats"):
        load_trace(write("t.yaml", "tasks:\n  - {at: 0, task: vgg, repeats: 3}\n"), catalog)
