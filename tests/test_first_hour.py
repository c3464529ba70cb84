"""What a new user meets first: the README's quickstart on fake GPUs, memory units, the queue's columns, a
replay's progress and summary beside the twin, shell completion and the help texts."""

from __future__ import annotations

import io
import json
import re
import shlex
from pathlib import Path

import pytest
from rich.console import Console

from carma.units import UNITS, parse_mib
from servers import free_port
from support import cli_env, run_carma

README = Path(__file__).parents[1] / "README.md"


def _quickstart() -> list[list[str]]:
    """The commands of the README's quickstart, as words (comments and a trailing `&` left out)."""
    section = README.read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [[w for w in shlex.split(line, comments=True) if w != "&"] for line in block.splitlines()]


def test_the_readme_quickstart_runs_on_fake_gpus(start_server):  # type: ignore[no-untyped-def]
    """Each command of the quickstart as written, through the real CLI; the server on a free port."""
    commands = _quickstart()
    assert [c[:2] for c in commands] == [
        ["carma", "server"], ["carma", "submit"], ["carma", "submit"], ["carma", "queue"], ["carma", "dashboard"],
        ["carma", "logs"], ["kill", "%1"],
    ]  # fmt: skip
    options = commands[0][2:]
    port = free_port()
    options[options.index("--tcp") + 1] = f"127.0.0.1:{port}"
    server = start_server(*options)
    answers = [server.cli(*command[1:]) for command in commands[1:4]]
    for answer in answers:
        assert answer.returncode == 0, answer.stderr
    assert answers[0].stdout == "submitted task 1 (carma): needs 8.00 GiB of GPU memory\n"
    queue, dashboard = answers[2], server.cli(*commands[4][1:])
    assert queue.stdout.splitlines()[0].split() == ["ID", "NAME", "USER", "STATE", "GPUS", "MEMORY", "ON", "TIME",
                                                    "REASON"]  # fmt: skip
    assert queue.stderr == "note: TIME is simulated: the server runs 60x faster than the wall clock (--time-scale 60)\n"
    assert dashboard.returncode == 0 and dashboard.stdout.startswith(f"http://127.0.0.1:{port}/#token=")
    follow = server.cli(*commands[5][1:])  # follows task 1, the fake job, to its end
    assert follow.returncode == 0 and "step 10/10" in follow.stdout, follow.stderr
    assert follow.stderr.rstrip().endswith("task 1 completed")
    assert server.cli("wait", 2).returncode == 0  # the real command ran, with the PATH's python
    assert server.cli("logs", 2).stdout == "hello from a task\n"


def test_queue_counts_gpus_and_says_on_which_a_task_runs(start_server):  # type: ignore[no-untyped-def]
    """GPUS showed a running task's indices and a waiting one's count in parentheses: `2` read as 2 GPUs."""
    server = start_server("--fake-gpus", "3xA100-40GB")
    running = server.submit("carma", "fakejob", "--mem", "1GiB", "--seconds", "1000", "--ttfk", "0", gpus=2)
    waiting = server.submit("sleep", "60", gpus=2)
    server.wait_state(running, "running")
    rows = {r.split()[0]: r.split() for r in server.cli("queue").stdout.splitlines()[1:]}
    on = ",".join(map(str, server.task(running)["attempt_list"][0]["gpus"]))
    assert rows[str(running)][4:7] == ["2", "unknown", on] and "," in on
    assert rows[str(waiting)][4:7] == ["2", "history", "-"]  # its need: from its command's runs, if any
    assert server.cli("queue").stderr == ""  # wall-clock times: no note
    assert "simulated" not in server.cli("status").stdout
    server.cli("cancel", running, waiting)


def test_status_says_that_times_are_simulated_under_a_time_scale(start_server):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "60")
    status = server.cli("status").stdout.splitlines()
    assert status[1] == "simulated time: the server runs 60x faster than the wall clock (--time-scale 60)"


# ----------------------------------------------------------------------------- memory sizes


def test_a_bare_memory_size_on_the_command_line_is_refused_listing_every_unit(tmp_path):
    """`--mem 8` was 8 MiB without a word; the error names both GiB and GB, which differ."""
    result = run_carma("submit", "--mem", "8", "--", "true", env=cli_env(CARMA_HOME=str(tmp_path)))
    assert result.returncode == 2
    assert result.stderr == f"error: --mem '8' has no unit: write e.g. 8GiB. {UNITS}\n"
    for unit in ("KiB", "MiB", "GiB", "TiB", "K,", "M,", "G,", "T ", "KB", "MB", "GB", "TB", "; B"):
        assert unit in UNITS
    fake = run_carma("fakejob", "--mem", "8", "--seconds", "1")
    assert fake.returncode == 2 and f"argument --mem: '8' has no unit: write e.g. 8GiB. {UNITS}" in fake.stderr


def test_a_number_stays_mib_where_that_is_documented():
    """Task files, the API and traces' `*_mib` columns take a number as MiB; the command line refuses it."""
    assert parse_mib(8) == parse_mib("8") == 8
    with pytest.raises(ValueError, match="has no unit"):
        parse_mib("8", bare_mib=False)
    assert parse_mib("8G", bare_mib=False) == parse_mib("8GiB") == 8192
    assert parse_mib("8GB", bare_mib=False) == 7630  # 8e9 bytes


def test_submit_says_the_need_as_the_server_read_it(start_server):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "2xA100-40GB")
    decimal = server.cli("submit", "--mem", "8GB", "--", "sleep", "60")
    assert decimal.stdout == "submitted task 1 (sleep): needs 7.45 GiB of GPU memory\n"
    both = server.cli("submit", "--gpus", "2", "--mem", "30G", "--", "sleep", "60")
    assert both.stdout == "submitted task 2 (sleep): needs 30.00 GiB of GPU memory on each of its GPUs\n"
    assert server.cli("submit", "--", "sleep", "60").stdout == "submitted task 3 (sleep)\n"  # no need given
    server.cli("cancel", 1, 2, 3)


# ----------------------------------------------------------------------------- replay beside the twin

QUICK_TRACE = "submit_s,task,gpus,solo_s,mem_mib,gract,smact\n0,quick,1,300,2000,0.5,0.4\n0,quick\n60,quick\n"


def test_a_replay_shows_progress_and_ends_in_hours_or_minutes_beside_the_twin(start_server, tmp_path):  # type: ignore[no-untyped-def]
    """It was silent after its last submission and ended with raw keys (`makespan_s 19054.3`)."""
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "200")
    trace = tmp_path / "quick.csv"
    trace.write_text(QUICK_TRACE)
    result = server.cli("replay", trace, "--wait")
    assert result.returncode == 0, result.stderr
    progress = [line for line in result.stderr.splitlines() if "ended" in line]
    assert progress[-1] == "3 of 3 tasks ended"
    counts = [int(re.fullmatch(r"(\d) of 3 tasks ended", line)[1]) for line in progress]  # type: ignore[index]
    assert counts == sorted(set(counts))
    tasks, times = result.stdout.splitlines()
    assert re.fullmatch(r"3 tasks: 3 completed, 0 failed, 0 cancelled; \d attempts? collocated", tasks), tasks
    config = r"MAGM recovery only on 1xA100-40GB \(MPS\)"
    twin = rf"the twin, same tasks \({config}\): [\d.]+ min \([+-][\d.]+% here\)"
    assert re.fullmatch(rf"makespan [\d.]+ min, \d out-of-memory crash(es)?; {twin}, \d out-of-memory crash(es)?",
                        times), times  # fmt: skip


def test_simulate_limit_runs_the_tasks_a_replay_limit_submits(start_server, tmp_path):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "200")
    trace = tmp_path / "quick.csv"
    trace.write_text(QUICK_TRACE)
    replay = server.cli("replay", trace, "--limit", "2", "--wait", "--json")
    assert replay.returncode == 0, replay.stderr
    twin = json.loads(replay.stdout)["twin"]
    simulated = run_carma("simulate", "--trace", trace, "--limit", "2", "--gpus", "1xA100-40GB", "--json")
    (run,) = json.loads(simulated.stdout)["runs"]
    assert run["tasks_completed"] == 2
    assert twin["config"] == "MAGM recovery only on 1xA100-40GB (MPS)"
    assert twin["makespan_s"] == round(run["makespan_s"], 1)


def test_a_replay_on_a_terminal_draws_a_bar_of_the_tasks_ended(monkeypatch):
    from carma.cli import replay

    terminal = io.StringIO()
    monkeypatch.setattr(replay, "err", Console(file=terminal, force_terminal=True, width=80))
    with replay._Progress(4, quiet=False) as progress:
        progress.ended(3)
        progress._bar.refresh()  # type: ignore[union-attr]
    assert "tasks ended" in terminal.getvalue() and "3/4" in terminal.getvalue()


# ----------------------------------------------------------------------------- completion and help


def test_shell_completion_completes_commands_and_options():
    script = run_carma("--show-completion", "bash", env=cli_env(_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION="1"))
    assert script.returncode == 0 and "_CARMA_COMPLETE=complete_bash" in script.stdout
    words = cli_env(_CARMA_COMPLETE="complete_bash", COMP_WORDS="carma qu", COMP_CWORD="1")
    assert run_carma(env=words).stdout.split() == ["queue"]
    options = cli_env(_CARMA_COMPLETE="complete_bash", COMP_WORDS="carma queue --a", COMP_CWORD="2")
    assert run_carma(env=options).stdout.split() == ["--all"]


def test_help_paragraphs_wrap_at_the_terminal_not_at_the_docstring():
    """Typer kept a docstring's line breaks after its first paragraph: lines were cut mid-phrase."""
    shown = run_carma("logs", "--help", env=cli_env(COLUMNS="250")).stdout
    assert re.search(r"All of it, chunk by chunk; .* relaunch it, and through a restart of the server", shown)


def test_estimate_device_lists_its_choices():
    from carma.estimate.devices import BUILTIN

    shown = " ".join(run_carma("estimate", "--help", env=cli_env(COLUMNS="250")).stdout.split())
    assert f"{', '.join(BUILTIN)}, or a name that `carma estimate calibrate` stored" in shown


def test_fakejob_is_a_carma_command_with_the_modules_options():
    shown = run_carma("fakejob", "--help")
    assert shown.returncode == 0 and shown.stdout.startswith("usage: carma fakejob [-h] --mem MEM --seconds SECONDS")
    outside = run_carma("fakejob", "--mem", "1GiB", "--seconds", "1", env=cli_env(CUDA_VISIBLE_DEVICES=""))
    assert (outside.returncode, outside.stderr) == (2, "fakejob: error: CUDA_VISIBLE_DEVICES is not set; run me on "
                                                       "fake GPUs (carma sets it)\n")  # fmt: skip


def test_the_version_comes_from_one_place():
    import carma

    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'version = { attr = "carma.__version__" }' in pyproject
    assert run_carma("--version").stdout == f"carma {carma.__version__}\n"
    changelog = (Path(__file__).parents[1] / "CHANGELOG.md").read_text()
    assert f"## {carma.__version__} " in changelog
