"""The daemon end to end on fake GPUs: the real `carma server`, the real CLI, real processes."""

from __future__ import annotations

import http.client
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from subprocess import PIPE

import pytest
import typer

import carma.server.client
from carma.cli import app
from carma.server.client import Client, ClientError, WaitTimeout
from carma.sim.experiment import RunConfig, simulate
from carma.traces.catalog import load_catalog
from carma.traces.loaders import Trace, load_trace
from servers import fakejob, free_port
from support import CARMA, cli_env, run_carma, wait_until

# ----------------------------------------------------------------------------- the basic workflow


def test_submit_queue_show_logs_cancel_wait(start_server):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "2xA100-40GB", "--time-scale", "50")
    quick = server.submit(*fakejob(60), mem="4GiB", name="quick")
    slow = server.submit(*fakejob(100000))
    done = server.cli("wait", quick)
    assert done.returncode == 0 and f"task {quick} completed" in done.stdout
    assert "step" in server.cli("logs", quick).stdout
    shown = server.json("show", quick)
    assert (shown["name"], shown["mem_mib"], shown["state"]) == ("quick", 4096, "completed")
    assert shown["attempt_list"][0]["outcome"] == "success"

    server.wait_state(slow, "running")
    queue = server.cli("queue")
    assert queue.returncode == 0 and "running" in queue.stdout and "quick" not in queue.stdout
    header, row = queue.stdout.splitlines()[:2]
    assert header.split()[4:6] == ["GPUS", "MEMORY"] and row.split()[5] == "unknown"  # no need given: recovery only
    listed = {t["id"]: t for t in server.json("queue", "--all")}
    assert {quick, slow} <= set(listed)
    assert (listed[quick]["need"], listed[quick]["need_mib"], listed[quick]["need_source"]) == ("known", 4096, "user")
    gpus = server.json("gpus")
    assert len(gpus) == 2 and any(slow in g["tasks"] for g in gpus)
    assert any(g["used_mib"] == 2048 for g in gpus)  # the fake device shows the job's allocation

    cancelled = server.cli("cancel", slow)
    assert cancelled.returncode == 0 and "SIGTERM" in cancelled.stdout
    end = server.cli("wait", slow, "--timeout", "30")
    assert end.returncode == 1 and f"task {slow} cancelled" in end.stdout
    assert "received SIGTERM" in server.cli("logs", slow, "--stderr").stdout
    follow = server.cli("logs", "-f", quick)  # follow ends by itself once the task has ended
    assert follow.returncode == 0 and "step" in follow.stdout


def test_a_known_need_is_held_on_its_gpu_before_it_is_allocated(start_server):  # type: ignore[no-untyped-def]
    """The GPU shows 38 GiB free while the first task has yet to allocate most of its 30 GiB: a second task
    placed into that memory crashed the first once it grew."""
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "50")
    first = server.submit(*fakejob(100000), mem="30GiB")  # the fake job allocates 2 GiB of it
    server.wait_state(first, "running")
    (gpu,) = server.json("gpus")
    assert (gpu["used_mib"], gpu["held_mib"]) == (2048, 30720)
    assert "2.0/40.0 GiB (30.0 held)" in server.cli("gpus").stdout
    second = server.submit(*fakejob(60), mem="10GiB")
    reason = wait_until(  # once the first task's TTFK window has passed
        lambda: "TTFK" not in (r := server.task(second)["waiting_reason"] or "TTFK") and r, 30, "the window to pass"
    )
    assert reason == (
        "needs 1 GPU with 12800 MiB free (need 10240 + margin 2048 + reserve 512); 0 have it (1 more shows it free, "
        "but their tasks' known needs or predicted growth hold it)"
    )
    server.cli("cancel", first, second)


def test_a_multi_gpu_tasks_need_is_per_gpu_and_shown_so(start_server):  # type: ignore[no-untyped-def]
    """`--gpus 2 --mem 30GiB` holds 30 GiB on each GPU, as queue and show say (a Slurm user reads a total)."""
    server = start_server("--fake-gpus", "2xA100-40GB", "--time-scale", "50")
    task = server.submit(*fakejob(100000), gpus=2, mem="30GiB")
    server.wait_state(task, "running")
    assert [g["held_mib"] for g in server.json("gpus")] == [30720, 30720]
    (row,) = [r for r in server.cli("queue").stdout.splitlines() if r.split()[0] == str(task)]
    assert "30.00 GiB/GPU" in row
    assert "memory need: 30720 MiB per GPU" in server.cli("show", task).stdout
    server.cli("cancel", task)


def test_a_task_not_yet_seen_on_its_gpu_says_so_in_the_queue(start_server):  # type: ignore[no-untyped-def]
    """`dispatched` with an empty reason left users guessing why `--state running` left the task out."""
    server = start_server("--fake-gpus", "1xA100-40GB")
    task = server.submit("sleep", "60")
    server.wait_state(task, "dispatched")
    (row,) = [r for r in server.cli("queue").stdout.splitlines() if r.split()[0] == str(task)]
    assert " dispatched " in row and row.rstrip().endswith("started; not yet seen on its GPU")
    server.cli("cancel", task)


def test_a_long_task_name_is_cut_in_the_listings_and_whole_in_show(start_server):  # type: ignore[no-untyped-def]
    """One 200-character name widened every line of `queue --all` and `history` past any terminal."""
    server = start_server("--fake-gpus", "1xA100-40GB")
    name = "sweep-" + "lr0.001-" * 24
    task = server.submit("true", name=name)
    assert server.cli("wait", task).returncode == 0
    for listing in (("queue", "--all"), ("history",)):
        (row,) = server.cli(*listing).stdout.splitlines()[1:]
        assert f"  {name[:31]}…  " in row and len(row) < 130, row
    assert f"task {task}: {name} (" in server.cli("show", task).stdout
    assert server.json("queue", "--all")[0]["name"] == name


def test_task_file_and_shell(start_server, tmp_path):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "20")
    task_file = tmp_path / "task.yaml"
    task_file.write_text(
        'name: greeter\ncommand: echo "hello $WHO" > out.txt\nshell: true\nenv: {WHO: world}\nworkdir: .\n'
    )
    task_id = json.loads(server.cli("submit", "-f", task_file, "--json").stdout)["id"]
    assert server.cli("wait", task_id).returncode == 0
    assert (tmp_path / "out.txt").read_text() == "hello world\n"
    quoted = tmp_path / "quoted.yaml"  # a command line without shell: true is split as a shell would
    quoted.write_text("""command: printf '[%s]' "a b" c\n""")
    task_id = json.loads(server.cli("submit", "-f", quoted, "--json").stdout)["id"]
    server.cli("wait", task_id)
    assert server.cli("logs", task_id).stdout == "[a b][c]"
    assert "command: printf '[%s]' 'a b' c\n" in server.cli("show", task_id).stdout  # shown as it was split
    literal = server.submit("/bin/echo", "$HOME", "a b", workdir=tmp_path)  # no shell: arguments as given
    server.cli("wait", literal)
    assert server.cli("logs", literal).stdout == "$HOME a b\n"
    (tmp_path / "elsewhere").mkdir()  # options override the file's values, as sbatch's do its #SBATCH lines
    flags = [
        "--name",
        "mine",
        "--estimate",
        "history",
        "--env",
        "WHO=you",
        "--env",
        "X=1",
        "--workdir",
        str(tmp_path / "elsewhere"),
        "--duration",
        "1h30m",
    ]
    task_id = json.loads(server.cli("submit", "-f", task_file, *flags, "--json").stdout)["id"]
    assert server.cli("wait", task_id).returncode == 0
    assert (tmp_path / "elsewhere" / "out.txt").read_text() == "hello you\n"
    shown = server.json("show", task_id)
    assert (shown["name"], shown["mem_mib"], shown["estimate"]) == ("mine", None, "history")
    assert shown["duration_s"] == 5400  # what backfilling reads before the command's history
    assert "expected run time: 90.0 min (declared)" in server.cli("show", task_id).stdout
    refused = server.cli("submit", "-f", task_file, "--shell")
    assert (refused.returncode, refused.stderr) == (
        2,
        "error: --shell applies to a command after --; a task file says `shell: true`\n",
    )


def test_a_task_file_given_by_a_relative_path_runs_in_its_folder(start_server, tmp_path):  # type: ignore[no-untyped-def]
    """`submit -f proj/task.yaml` without a workdir took proj/proj, which does not exist."""
    server = start_server("--fake-gpus", "1xA100-40GB")
    server.cli("drain")
    (tmp_path / "proj" / "sub").mkdir(parents=True)
    (tmp_path / "proj" / "plain.yaml").write_text("command: [pwd]\n")
    (tmp_path / "proj" / "nested.yaml").write_text("command: [pwd]\nworkdir: sub\n")
    for name, workdir in (("plain", tmp_path / "proj"), ("nested", tmp_path / "proj" / "sub")):
        result = run_carma("submit", "--json", "-f", f"proj/{name}.yaml", cwd=tmp_path, env=server.env)
        assert result.returncode == 0, result.stderr
        assert server.task(json.loads(result.stdout)["id"])["workdir"] == str(workdir)


def test_a_task_file_on_standard_input_or_a_pipe_runs_in_the_current_folder(start_server, tmp_path):  # type: ignore[no-untyped-def]
    """`-f -` was "no task file '-'"; `-f /dev/stdin` ran the task in /dev, and `-f <(...)` in /proc/PID/fd."""
    server = start_server("--fake-gpus", "1xA100-40GB")
    server.cli("drain")
    for file in ("-", "/dev/stdin"):
        result = subprocess.run(
            [CARMA, "submit", "--json", "-f", file],
            input="command: [pwd]\n",
            cwd=tmp_path,
            env=server.env,
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stderr
        assert server.task(json.loads(result.stdout)["id"])["workdir"] == str(tmp_path)
    bad = subprocess.run([CARMA, "submit", "-f", "-"], input="[", env=server.env, capture_output=True, text=True)
    assert bad.stderr.startswith("error: standard input: not valid YAML (line 1")


def test_bytes_that_are_not_utf8_are_refused_in_a_command_and_left_out_of_the_environment(start_server):  # type: ignore[no-untyped-def]
    """`echo caf\\xe9` was queued and ran, but the submission answered HTTP 500 (resubmitted: twice), and so
    did `show` of it and everyone's `history`; a shell variable in Latin-1 made every submission so."""
    server = start_server("--fake-gpus", "1xA100-40GB")
    latin1 = os.fsdecode(b"caf\xe9")  # as Python reads the bytes from argv or the environment
    refused = server.cli("submit", "--", "echo", latin1)
    assert (refused.returncode, refused.stderr) == (
        2,
        "error: invalid request: argument 2 of the command is not UTF-8 text (bytes of another encoding?)\n",
    )
    assert server.json("queue", "--all") == []
    submitted = server.cli("submit", "--json", "--", "sh", "-c", "echo odd=$ODD", env={"ODD": latin1})
    assert submitted.returncode == 0 and submitted.stderr == (
        "note: not passed to the task, their values are not UTF-8 text: ODD\n"
    )
    task_id = json.loads(submitted.stdout)["id"]
    assert server.cli("wait", task_id).returncode == 0
    assert server.cli("logs", task_id).stdout == "odd=\n"
    assert server.cli("history").returncode == 0


def test_tasks_inherit_the_submitters_environment_unless_clean(start_server, tmp_path):  # type: ignore[no-untyped-def]
    """As sbatch exports it: a task finds its user's HOME, PATH and settings, never their carma token."""
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "20")
    mine = {"MY_SETTING": "on", "CARMA_TOKEN": "secret", "CUDA_VISIBLE_DEVICES": "7"}
    show = ["sh", "-c", "echo setting=$MY_SETTING token=$CARMA_TOKEN home=${HOME:+set} cvd=$CUDA_VISIBLE_DEVICES"]

    def run(*flags: str) -> str:
        result = server.cli("submit", "--json", *flags, "--", *show, env=mine)
        task_id = json.loads(result.stdout)["id"]
        server.cli("wait", task_id)
        return server.cli("logs", task_id).stdout

    inherited = run("--env", "MY_SETTING=overridden")
    assert inherited.startswith("setting=overridden token= home=set cvd=GPU-fake-")
    assert run("--clean-env").startswith("setting= token= home= cvd=GPU-fake-")


def test_failing_task_fails_with_its_reason(start_server):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "50")
    task_id = server.submit(*fakejob(30, "1GiB", "--exit-code", "3"))
    result = server.cli("wait", task_id)
    assert result.returncode == 1
    task = server.task(task_id)
    assert task["state"] == "failed" and task["reason"].startswith("exit code 3")
    quiet = server.submit("sh", "-c", "echo env looks fine; exit 4")  # no errors written: stdout's last line
    loud = server.submit("sh", "-c", "echo working; echo no such file: data.csv >&2; exit 5")
    server.cli("wait", quiet, loud)
    assert server.task(quiet)["reason"] == "exit code 4 (its last output: env looks fine)"  # not read as the cause
    assert server.task(loud)["reason"] == "exit code 5: no such file: data.csv"


def test_status_reports_the_caller_from_the_socket(start_server):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB")
    status = server.json("status")
    assert status["you"] == {"user": "root" if os.geteuid() == 0 else status["you"]["user"], "uid": os.geteuid(),
                             "admin": True}  # fmt: skip
    mode = (server.home / "carma.sock").stat().st_mode & 0o777
    assert mode == 0o600 if os.geteuid() != 0 else mode in (0o660, 0o666)


def test_client_without_a_server_says_so_in_one_line():
    home = tempfile.mkdtemp(prefix="c", dir="/tmp")
    result = run_carma("queue", env=cli_env(CARMA_HOME=home))
    shutil.rmtree(home)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "carma server is not running" in result.stderr


def test_a_second_server_on_the_same_state_dir_is_refused(start_server):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB")
    second = server.cli("server", "--fake-gpus", "1xA100-40GB")
    assert second.returncode == 2 and "already running" in second.stderr


def test_a_second_server_is_refused_even_when_the_first_ones_socket_is_gone(start_server):  # type: ignore[no-untyped-def]
    """Only the socket's answer was asked: with it removed (a /tmp cleaner, a stray rm), a second daemon
    started on the same state and both launched the same queued task."""
    server = start_server("--fake-gpus", "1xA100-40GB")
    (server.home / "carma.sock").rename(server.home / "moved.sock")
    command = [CARMA, "server", "--fake-gpus", "1xA100-40GB"]  # started, it would serve until killed
    second = subprocess.run(command, env=server.env, capture_output=True, text=True, timeout=30)
    assert (second.returncode, second.stderr) == (
        2,
        f"error: a carma server (pid {server.proc.pid}) is already running on {server.home}, though its socket "
        f"{server.home / 'carma.sock'} is gone: stop it first\n",
    )
    assert not (server.home / "carma.sock").exists()  # the second one changed nothing
    (server.home / "moved.sock").rename(server.home / "carma.sock")
    assert server.cli("status").returncode == 0


def test_a_time_scale_that_is_not_a_positive_number_is_refused_leaving_the_state_dir_usable(start_server):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "10")
    server.stop()
    for scale in ("inf", "0", "-5", "nan"):  # inf was kept as the clock's scale: every later start crashed
        refused = server.cli("server", "--fake-gpus", "1xA100-40GB", "--time-scale", scale)
        kind = "finite" if scale == "inf" else "positive"
        assert (refused.returncode, refused.stderr) == (
            2,
            f"error: --time-scale must be a {kind} number; got {scale}\n",
        )
    server.start()
    assert server.cli("wait", server.submit("true"), "--timeout", "30").returncode == 0


def test_a_drain_lasts_across_a_restart_until_resume(start_server):  # type: ignore[no-untyped-def]
    """Drained for maintenance, which often means a restart: the restarted daemon placed the queue at once."""
    server = start_server("--fake-gpus", "1xA100-40GB")
    server.cli("drain")
    submitted = server.cli("submit", "--", "true")  # said at once: nothing else showed the task would wait
    assert submitted.stderr == "note: the server is draining: no placements until `carma resume`\n"
    task = int(submitted.stdout.split()[2])
    server.stop()
    server.start()
    again = server.cli("drain").stdout  # the same words as the first drain's, as if it had changed something
    assert again == "already draining: no new placements until `carma resume`\n"
    time.sleep(2)  # a couple of scheduling steps
    assert server.task(task)["state"] == "queued" and "draining" in server.cli("queue").stdout
    started = (server.home / "test-server.log").read_text().splitlines()
    assert [line for line in started if "listening" in line][-1].endswith(
        "; draining, as before the restart: no placements until `carma resume`"
    )
    waited = server.cli("wait", task, "--timeout", "0", "--json")
    assert json.loads(waited.stdout)[0]["waiting_reason"].startswith("the server is draining")
    assert server.cli("resume").stdout == "placing tasks again\n"
    assert server.cli("resume").stdout == "not draining: placing tasks as before\n"
    assert server.cli("wait", task, "--timeout", "30").returncode == 0


def test_wait_outlives_a_restart_of_the_server(start_server):  # type: ignore[no-untyped-def]
    """A script's `carma wait` across a daemon upgrade: it exited 2 ("not running") the moment the daemon stopped."""
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "50")
    task = server.submit(*fakejob(400))
    server.wait_state(task, "running")
    waiting = subprocess.Popen([CARMA, "wait", str(task)], env=server.env, stdout=PIPE, stderr=PIPE, text=True)
    time.sleep(1)
    server.stop()
    time.sleep(2)
    server.start()
    stdout, stderr = waiting.communicate(timeout=60)
    assert (waiting.returncode, stdout, stderr) == (0, f"task {task} completed\n", "")


def test_logs_follow_outlives_a_restart_of_the_server(start_server):  # type: ignore[no-untyped-def]
    """`carma logs -f` exited 2 ("not running") the moment the daemon stopped, while its task ran on."""
    server = start_server("--fake-gpus", "1xA100-40GB")
    task = server.submit("sh", "-c", "for i in $(seq 1 12); do echo line $i; sleep 0.5; done")
    server.wait_state(task, "dispatched")  # never "running": it does not show on its GPU
    following = subprocess.Popen([CARMA, "logs", str(task), "-f"], env=server.env, stdout=PIPE, stderr=PIPE, text=True)
    time.sleep(1)
    server.stop()
    time.sleep(2)
    server.start()
    stdout, stderr = following.communicate(timeout=60)
    assert (following.returncode, stdout) == (0, "".join(f"line {i}\n" for i in range(1, 13)))
    assert stderr == (
        f"carma: the server stopped answering; following task {task}'s log when it is back\n"
        f"carma: task {task} completed\n"
    )


def test_a_followed_character_split_across_two_writes_arrives_whole(start_server):  # type: ignore[no-untyped-def]
    """The live end of a running task's log was decoded as final: the first bytes of a character whose rest
    was not written yet became U+FFFD, and the follower read on past them."""
    server = start_server("--fake-gpus", "1xA100-40GB")
    split = "import sys, time; out = sys.stdout.buffer; out.write(b'x\\xe2\\x82'); out.flush(); time.sleep(2)"
    task = server.submit("python", "-c", split + "; out.write(b'\\xac y\\n')")
    server.wait_state(task, "dispatched")
    following = subprocess.Popen([CARMA, "logs", str(task), "-f"], env=server.env, stdout=PIPE, stderr=PIPE)
    stdout, _ = following.communicate(timeout=60)
    assert (following.returncode, stdout) == (0, "x\u20ac y\n".encode())


def test_logs_of_a_task_not_started_say_why_and_a_follower_says_how_it_ended(start_server):  # type: ignore[no-untyped-def]
    """`carma logs` printed nothing for a waiting task, as for one that printed nothing; `-f` ended on a
    failed task as on a completed one."""
    server = start_server("--fake-gpus", "1xA100-40GB")
    server.cli("drain")
    task = server.submit("sh", "-c", "echo partial; exit 3")
    waiting = server.cli("logs", task)
    assert (waiting.returncode, waiting.stdout) == (0, "")
    assert waiting.stderr == (
        f"carma: task {task} has not started: no output yet. It is queued: the server is draining: no placements "
        "until `carma resume`\n"
    )
    following = subprocess.Popen([CARMA, "logs", str(task), "-f"], env=server.env, stdout=PIPE, stderr=PIPE, text=True)
    time.sleep(1)
    server.cli("resume")
    stdout, stderr = following.communicate(timeout=60)
    assert (following.returncode, stdout) == (0, "partial\n")  # the status is `carma wait`'s to give
    assert stderr.splitlines()[-1] == f"carma: task {task} failed: exit code 3 (its last output: partial)"
    server.cli("drain")
    never = server.submit("true")
    server.cli("cancel", never)
    assert server.cli("logs", never).stderr == f"carma: task {never} never ran: cancelled by request\n"


def test_a_risk_filter_switched_off_is_said_by_status_and_gpus(start_server, tmp_path):  # type: ignore[no-untyped-def]
    """A saturated GPU read `ok` with nothing saying the filter was off; `status --json` left out its weights
    and `missing`, so the server's settings could not be read back."""
    config = tmp_path / "norisk.toml"
    config.write_text('[scheduler.risk]\nenabled = false\nmissing = "skip"\n')
    server = start_server("--fake-gpus", "1xA100-40GB", "--config", str(config))
    status = server.cli("status")
    assert status.stdout.startswith("carma ") and ", policy magm, risk filter off; " in status.stdout
    risk = server.json("status")["risk"]
    assert (risk["enabled"], risk["missing"], risk["weights"]) == (
        False, "skip", {"mean": 0.2, "median": 0.3, "p95": 0.3, "ema": 0.2}
    )  # fmt: skip
    gpus = server.cli("gpus")
    assert gpus.returncode == 0 and gpus.stderr == (
        "note: the risk filter is off ([scheduler.risk] enabled = false): no GPU is kept out for its risk\n"
    )


def test_wait_that_gives_up_still_prints_every_state_as_json(start_server):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "50")  # the failing task waits a TTFK window
    done, slow = server.submit("true"), server.submit(*fakejob(100000))
    server.wait_state(done, "completed")
    server.wait_state(slow, "running")
    gave_up = server.cli("wait", done, slow, "--timeout", "0.5", "--json")
    assert gave_up.returncode == 3 and gave_up.stderr == f"error: timed out waiting for task {slow}\n"
    assert [(t["id"], t["state"]) for t in json.loads(gave_up.stdout)] == [(done, "completed"), (slow, "running")]
    failed = server.submit("sh", "-c", "echo broken >&2; exit 3")
    server.wait_state(failed, "failed")
    said = server.cli("wait", failed, slow, "--timeout", "0.5")  # as text: the failure among them went unsaid
    assert said.returncode == 3 and said.stderr == f"error: timed out waiting for task {slow}\n"
    assert said.stdout.startswith(f"task {failed} failed: exit code 3")
    server.cli("cancel", slow)


def test_wait_gives_up_on_a_server_that_does_not_come_back(start_server):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB")
    task = server.submit(*fakejob(100000))
    server.wait_state(task, "running")
    errors: list[ClientError] = []

    def wait() -> None:
        try:
            server.client.wait([task], reconnect_s=1)
        except ClientError as e:
            errors.append(e)

    waiting = threading.Thread(target=wait)
    waiting.start()
    time.sleep(1)
    server.stop()
    assert not (server.home / "carma.sock").exists()  # a stopped server left it, to be removed at its next start
    waiting.join(30)
    assert [str(e) for e in errors] == [
        f"the carma server is not running (nothing answers at {server.home / 'carma.sock'}); start it with "
        f"`carma server`; gave up waiting for task {task} after 1 s"
    ]
    assert isinstance(errors[0], WaitTimeout) and errors[0].tasks[0]["state"] == "running"  # `wait` exits 3
    server.start()
    server.cli("cancel", task)


@pytest.mark.parametrize("command", [["wait"], ["logs", "-f"]])
def test_a_follower_giving_up_on_a_stopped_server_exits_3_not_2_as_for_bad_input(  # type: ignore[no-untyped-def]
    start_server, monkeypatch, capsys, command
):
    server = start_server("--fake-gpus", "1xA100-40GB")
    task = server.submit(*fakejob(100000))
    server.wait_state(task, "running")
    monkeypatch.setattr(carma.server.client, "RECONNECT_S", 1.0)
    monkeypatch.setenv("CARMA_HOME", str(server.home))
    stopping = threading.Timer(1, server.stop)
    stopping.start()
    with pytest.raises(SystemExit) as ended:
        typer.main.get_command(app).main([*command, str(task)], prog_name="carma")
    stopping.join()
    assert ended.value.code == 3
    assert capsys.readouterr().err.endswith("after 1 s\n")
    server.start()
    server.cli("cancel", task)


def test_starting_with_other_fake_gpus_takes_no_gpu_from_a_task(start_server):  # type: ignore[no-untyped-def]
    """A mistyped second start, on the running daemon's state dir or after it stopped while a task runs, is
    refused before it touches the fake GPUs (once, it made new ones: the task lost its GPU, and the state
    dir could not start again)."""
    server = start_server("--fake-gpus", "2xA100-40GB", "--time-scale", "60")
    task = server.submit(*fakejob(100000))
    server.wait_state(task, "running")
    mistyped = server.cli("server", "--fake-gpus", "2xA100-40GB")  # --time-scale forgotten
    assert mistyped.returncode == 2 and "already running" in mistyped.stderr
    assert [g["used_mib"] for g in server.json("gpus")] == [2048, 0]
    server.stop()  # the task runs on
    mistyped = server.cli("server", "--fake-gpus", "1xA100-40GB")
    assert (mistyped.returncode, mistyped.stderr) == (
        2,
        "error: the fake GPUs of the last start still hold 1 task: start it as then, --fake-gpus "
        "2xA100-40GB --time-scale 60 --sharing mps (or with a new CARMA_HOME)\n",
    )
    server.start()
    assert server.task(task)["state"] == "running"
    assert [g["used_mib"] for g in server.json("gpus")] == [2048, 0]
    server.cli("cancel", task)


def test_a_queued_task_a_restart_on_fewer_gpus_cannot_run_fails_and_the_server_runs_on(start_server):  # type: ignore[no-untyped-def]
    """It stopped the daemon at its first scheduling step, at every start, so that nothing could cancel it."""
    server = start_server("--fake-gpus", "2xA100-40GB")
    server.cli("drain")
    pair, single = server.submit("true", gpus=2, name="pair"), server.submit("true")
    server.stop()
    server.options = ("--fake-gpus", "1xA100-40GB")
    server.start()
    server.cli("resume")
    assert server.cli("wait", single).returncode == 0
    assert server.task(pair)["reason"] == "task 'pair' needs 2 GPUs but this server has 1 since it restarted"
    assert f"task {pair} failed: task 'pair' needs 2 GPUs" in (server.home / "test-server.log").read_text()
    server.stop()
    server.start()  # stored as failed
    assert server.task(pair)["state"] == "failed"


# ----------------------------------------------------------------------------- bad input


def test_malformed_requests_get_one_clear_line_and_change_nothing(start_server, tmp_path):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "2xA100-40GB")
    server.cli("drain")
    kept = server.submit("true")
    before = server.json("queue", "--all")
    cases = [
        (["submit", "--gpus", "-1", "--", "true"], "greater than or equal to 1"),
        (["submit", "--gpus", "3", "--", "true"], "needs 3 GPUs but this server has 2"),
        (["submit", "--mem", "lots", "--", "true"], "cannot read 'lots' as a memory size"),
        (["submit", "--mem", "999GiB", "--", "true"], "more than any GPU of this server has (40.00 GiB)"),
        (
            ["submit", "--mem", "99999999TiB", "--", "true"],
            "memory size '99999999TiB' is over 1 PiB",
        ),  # was float noise
        (
            ["submit", "--mps-threads", "50", "--", "true"],
            "applies to a server started with --mps, and this one was not",
        ),
        (["submit"], "nothing to run"),
        (
            ["submit", "--workdir", "/does/not/exist", "--", "true"],
            "working directory '/does/not/exist' does not exist",
        ),
        (["submit", "--env", "1BAD=x", "--", "true"], "environment variable name '1BAD'"),
        (["submit", "--env", "NOEQUALS", "--", "true"], "--env takes KEY=VALUE"),
        (["submit", "-f", tmp_path / "missing.yaml"], "no task file"),
        (["show", "999"], "no task with id 999"),
        (["cancel", "999"], "no task with id 999"),
        (["logs", "999"], "no task with id 999"),
        (["logs", kept, "--attempt", "5"], f"task {kept} has no attempt 5"),
        (["submit", "--workdir", "/proc/version", "--", "true"], "'/proc/version' is not a directory"),
        (["submit", "-f", tmp_path], "cannot read task file"),  # a directory
        (["submit", "-f", _file(tmp_path, "latin.yaml", b"command: caf\xe9\n")], "latin.yaml: not UTF-8 text"),
        (["submit", "-f", _file(tmp_path, "wd.yaml", b"command: 'true'\nworkdir: 5\n")], "workdir must be a path"),
        (["submit", "-f", _file(tmp_path, "q.yaml", b"command: echo 'a\n")], "cannot split command"),
        (
            ["submit", "-f", _file(tmp_path, "twice.yaml", b"command: echo a\nshell: true\ncommand: echo b\n")],
            "twice.yaml: not valid YAML (line 3: key 'command' given twice in one mapping)",  # was: echo b ran
        ),
        (  # was START=5400
            ["submit", "-f", _file(tmp_path, "sixty.yaml", b"command: true\nenv: {START: 1:30:00}\n")],
            "sixty.yaml: not valid YAML (line 2: 1:30:00 is YAML 1.1's base-60 for 5400: write the number, or quote "
            "it)",
        ),
        (  # these three were the server's "invalid request: command: Field required", naming no file
            ["submit", "-f", _file(tmp_path, "t.toml", b'command = ["true"]\n')],
            "t.toml: a task file is a YAML mapping with at least 'command' (task files are YAML; carma's configuration "
            "file is the TOML one)",
        ),
        (["submit", "-f", _file(tmp_path, "nocmd.yaml", b"name: x\n")], "nocmd.yaml: 'command' is missing or empty"),
        (  # was "command = 42: Input should be a valid list", though a command line is taken
            ["submit", "-f", _file(tmp_path, "num.yaml", b"command: 42\n")],
            "num.yaml: command must be a command line or a list of arguments, not 42",
        ),
        (
            ["submit", "-f", _file(tmp_path, "bool.yaml", b"command: true\n")],
            "not True (YAML reads true and false as booleans: quote the program's name)",
        ),
        (  # was "Input should be a valid string (quote it in a task file)", though `mem: 8192` is taken
            ["submit", "-f", _file(tmp_path, "half.yaml", b"command: 'true'\nmem: 1.5\n")],
            "mem = 1.5: a size without a unit is whole MiB; give a fraction with its unit, e.g. '1.5GiB'",
        ),
        (
            ["submit", "-f", _file(tmp_path, "inf.yaml", b"command: 'true'\nmem: .inf\n")],
            "mem = inf: a memory size is a",
        ),
        (  # was told to give a fraction with its unit
            ["submit", "-f", _file(tmp_path, "huge.yaml", b"command: 'true'\nmem: 1.0e+300\n")],
            "mem = 1e+300: a size without a unit is whole MiB, written as an integer, or give it with its unit",
        ),
        (["submit", "-f", _file(tmp_path, "blank.yaml", b"command: '  '\n")], "blank.yaml: 'command' is missing or"),
        (["queue", "--state", "queud"], "state must be one of queued, "),
        (["submit", "--", ""], "command: its program is empty"),  # these three were a 500 Internal Server Error
        (["submit", "--shell", "--", " "], "command: its program is empty"),
        (["submit", "--name", "evil\x1b[31mred", "--", "true"], "name 'evil\\x1b[31mred' holds a control character"),
        (["submit", "--name", "two\nlines", "--", "true"], "holds a control character"),
        (  # it said "name", which the user had not given
            ["submit", "--", "./bad\x07prog"],
            "the program's name, the task's name when none is given, 'bad\\x07prog' holds a control character",
        ),
        (["history", "--hours", "0"], "--hours must be a positive number; got 0"),  # was the API's query.hours
        (["history", "--hours", "inf"], "--hours must be a finite number; got inf"),  # "positive ... got inf"
        (["wait", "1", "--timeout", "nan"], "--timeout must be a number of seconds; got nan"),  # it waited forever
        (["submit", "--duration", "90", "--", "true"], "--duration: cannot read '90' as a run time: write e.g. 2h"),
        (["submit", "-f", _file(tmp_path, "long.yaml", b"command: run\nduration: 2 weeks\n")], "duration: cannot"),
        (  # a number is seconds: it was told to be quoted, and quoted it is no run time
            ["submit", "-f", _file(tmp_path, "zero.yaml", b"command: run\nduration: 0\n")],
            "invalid request: duration: a run time must be above 0 and at most a year, got 0",
        ),
        (["submit", "-f", _file(tmp_path, "yes.yaml", b"command: run\nduration: true\n")], "a number of seconds"),
    ]
    for args, message in cases:
        result = server.cli(*args)
        assert result.returncode == 2, args
        assert result.stderr.count("\n") == 1 and message in result.stderr, (args, result.stderr)
    write = "write http://HOST:PORT or https://HOST[:PORT][/PATH]"
    for settings, message in [
        ({"CARMA_URL": "127.0.0.1:8765"}, f"cannot use CARMA_URL '127.0.0.1:8765': {write}"),
        ({"CARMA_URL": "http://127.0.0.1:99999"}, f"cannot use CARMA_URL 'http://127.0.0.1:99999': {write}"),
        ({"CARMA_URL": "ftp://h:1"}, f"cannot use CARMA_URL 'ftp://h:1': {write}"),
        ({"CARMA_TOKEN": "tok\nX: 1"}, "cannot use CARMA_TOKEN: a token is printable ASCII without spaces"),
    ]:  # the port out of range and the token were tracebacks
        unusable = server.cli("queue", env=settings)
        assert (unusable.returncode, unusable.stderr) == (2, f"error: {message}\n")
    timed_out = server.cli("wait", kept, "--timeout", "0")
    assert (timed_out.returncode, timed_out.stderr) == (3, f"error: timed out waiting for task {kept}\n")
    with pytest.raises(ClientError, match="the command, working directory or environment holds a NUL byte"):
        server.client.submit({"command": ["tr", "a\0b"], "workdir": "/tmp"})
    for too_big, message in [  # accepted, then failed at launch with E2BIG naming carma's interpreter
        ({"command": ["echo", "x" * 200_000]}, "an argument is 200001 bytes; Linux passes at most 131072 bytes each"),
        ({"command": ["true"], "env": {"X": "y" * 140_000}}, "an environment variable is 140003 bytes; Linux passes"),
        ({"command": ["true"], "env": {f"V{i}": "y" * 1000 for i in range(3000)}}, "the command and environment are"),
    ]:
        with pytest.raises(ClientError, match=f"^invalid request: {message}"):
            server.client.submit({**too_big, "workdir": "/tmp"})
    for request, message in [  # were `command.3: ...` and `mem.str: ...`, naming neither the value nor the item
        (
            {"command": ["python", "train.py", "--lr", 0.1]},
            "command[3] = 0.1: Input should be a valid string (quote it",
        ),
        ({"command": ["true"], "mem": 8192.5}, "mem = 8192.5: a size without a unit is whole MiB"),
    ]:
        with pytest.raises(ClientError, match=re.escape(f"invalid request: {message}")):
            server.client.submit({**request, "workdir": "/tmp"})
    with pytest.raises(ClientError, match="offset = '9223372036854775807': Input should be less than or equal to"):
        server.client.logs(kept, offset=2**63 - 1)  # was a 500: seeking that far fails
    bad_file = tmp_path / "bad.yaml"
    bad_file.write_text("command: [true]\ngpu: 2\n")
    result = server.cli("submit", "-f", bad_file)
    assert result.returncode == 2 and "unknown key(s) gpu" in result.stderr
    assert server.json("queue", "--all") == before


def test_show_escapes_control_characters_of_a_command(start_server, tmp_path):  # type: ignore[no-untyped-def]
    """Anyone's command is shown on the admin's terminal: an escape sequence must not act there."""
    server = start_server("--fake-gpus", "1xA100-40GB")
    server.cli("drain")
    folder = tmp_path / "a\x1b[2Jb"
    folder.mkdir()
    task = server.submit("echo", "\x1b[31mred", "two\nlines", "café", workdir=folder)
    shown = server.cli("show", task).stdout
    assert "command: echo '\\x1b[31mred' 'two\\nlines' 'café'\n" in shown
    assert "workdir: " + str(tmp_path) + "/a\\x1b[2Jb;" in shown and "\x1b" not in shown


def test_piped_output_keeps_each_line_whole(start_server, tmp_path):  # type: ignore[no-untyped-def]
    """A failure's reason longer than the 200 columns a pipe gets was broken in two, and grep found half."""
    server = start_server("--fake-gpus", "1xA100-40GB")
    why = "ValueError: " + "x" * 220  # under the reason's 300 characters, over the 200 columns
    task = server.submit(sys.executable, "-c", f"raise SystemExit({why!r})", workdir=tmp_path)
    waited = server.cli("wait", task)
    assert waited.returncode == 1 and f"exit code 1: {why}" in waited.stdout.splitlines()[-1]
    assert any(line.endswith(f"exit code 1: {why}") for line in server.cli("show", task).stdout.splitlines())


def _file(folder: Path, name: str, content: bytes) -> Path:
    (folder / name).write_bytes(content)
    return folder / name


def test_cancel_goes_on_past_an_id_it_cannot_cancel(start_server):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB")
    server.cli("drain")
    first, second = server.submit("true"), server.submit("true")
    reasons = wait_until(lambda: [t["waiting_reason"] for t in server.json("queue") if t["waiting_reason"]], 10, "")
    assert reasons[0] == "the server is draining: no placements until `carma resume`"  # not "behind the head"
    result = server.cli("cancel", first, 999, second, first)  # an id given twice is answered once
    assert result.returncode == 2 and result.stderr == "error: no task with id 999\n"
    assert result.stdout == f"task {first}: cancelled\ntask {second}: cancelled\n"
    assert server.cli("queue", "--state", "queued").stdout.count("\n") == 1  # the header alone


def test_a_task_stopping_after_a_cancel_says_so_and_a_second_cancel_sends_nothing(start_server):  # type: ignore[no-untyped-def]
    """In the grace period before SIGKILL, the task looked like any running one, and a second cancel said
    it had sent SIGTERM again."""
    server = start_server("--fake-gpus", "1xA100-40GB", "--grace", "30")
    task = server.submit("sh", "-c", "trap '' TERM; sleep 60")
    server.wait_state(task, "dispatched")
    assert server.cli("cancel", task).stdout == f"task {task}: stopping (SIGTERM sent)\n"
    assert server.cli("cancel", task).stdout == f"task {task}: already stopping (cancelled before)\n"
    stopping = "cancelled; stopping (SIGTERM sent, SIGKILL if it runs on after 30 s)"
    (row,) = [r for r in server.cli("queue").stdout.splitlines() if r.split()[0] == str(task)]
    assert " dispatched " in row and row.rstrip().endswith(stopping)
    assert f"now: {stopping}\n" in server.cli("show", task).stdout
    assert server.task(task)["activity"] == stopping


def test_cancelling_many_tasks_starts_none_of_the_waiting_ones(start_server, tmp_path):  # type: ignore[no-untyped-def]
    """One request per id: each running task's cancel freed its GPU, and a waiting task was placed there
    before its own cancel came (18 of 100 ran their command)."""
    server = start_server("--fake-gpus", "2xA100-40GB", "--time-scale", "600")
    running = [server.submit("sleep", "1000") for _ in range(2)]
    for t in running:
        server.wait_state(t, "dispatched", "running")
    touch = shutil.which("touch")  # through the API: 40 `carma submit` processes took most of the test's time
    waiting = [server.client.submit({"command": [touch, str(tmp_path / f"ran-{i}")], "workdir": str(tmp_path)})["id"]
               for i in range(40)]  # fmt: skip
    result = server.cli("cancel", *running, *waiting, 999)
    assert (result.returncode, result.stderr) == (2, "error: no task with id 999\n")
    lines = result.stdout.splitlines()
    assert lines[:2] == [f"task {t}: stopping (SIGTERM sent)" for t in running]
    assert lines[2:] == [f"task {t}: cancelled" for t in waiting]
    time.sleep(2)
    assert list(tmp_path.glob("ran-*")) == [] and all(server.task(t)["attempts"] == 0 for t in waiting)
    many = server.cli("wait", *running, *waiting, "--json")  # beyond a few ids, one listing per poll
    assert many.returncode == 1 and {t["state"] for t in json.loads(many.stdout)} == {"cancelled"}


def test_raw_api_rejections(start_server):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB")
    server.cli("drain")
    api = server.client
    for body, message in (
        ({"command": [], "workdir": "/tmp"}, "command"),
        ({"command": ["true"], "workdir": "/tmp", "colour": "red"}, "colour"),
        ({"command": ["a", "b"], "workdir": "/tmp", "shell": True}, "one shell line"),
        ({"command": ["true"]}, "workdir"),
        ({"command": ["true"], "workdir": "/tmp", "gpus": True}, "gpus = True: Input should be a valid integer"),
        ({"command": ["true"], "workdir": "/tmp", "shell": "yes"}, "shell = 'yes': Input should be a valid boolean"),
        ({"command": ["true"], "workdir": "/tmp", "mem": True}, "mem"),
    ):
        with pytest.raises(ClientError, match=message):
            api.submit(body)
    assert api.tasks(all=True) == []
    schema = api.request("GET", "/openapi.json")
    assert "/v1/tasks" in schema["paths"]


# ----------------------------------------------------------------------------- who may do what


def test_a_token_given_twice_in_the_tokens_file_stops_the_start():
    """Pasted for a second user, the same token made every request of the first one the second's."""
    home = Path(tempfile.mkdtemp(prefix="c", dir="/tmp"))
    (home / "tokens").write_text("# ops\nsame-token-0123456 alice 1000\n\nsame-token-0123456 bob 1001 admin\n")
    (home / "tokens").chmod(0o600)
    command = [CARMA, "server", "--fake-gpus", "1xA100-40GB", "--tcp", f"127.0.0.1:{free_port()}"]
    started = subprocess.run(command, capture_output=True, text=True, env=cli_env(CARMA_HOME=str(home)), timeout=30)
    leftover = sorted(p.name for p in home.iterdir())
    shutil.rmtree(home)
    assert started.returncode == 2  # before it, a warning if uid 1000 has an account of another name here
    assert started.stderr.splitlines()[-1] == f"error: {home / 'tokens'}, line 4: this token is already on line 2"
    assert "fake-gpus" not in leftover  # stopped before it made its GPUs


def test_a_dry_run_says_whether_the_server_would_take_the_task_and_submits_nothing(start_server):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB")
    taken = server.cli("submit", "--dry-run", "--mem", "8GiB", "--name", "train", "--", "true")
    assert (taken.returncode, taken.stdout) == (0, "the server would take task 'train'; nothing was submitted\n")
    assert json.loads(server.cli("submit", "--dry-run", "--json", "--", "true").stdout) == {
        "dry_run": True,
        "name": "true",
        "draining": False,
    }
    server.cli("drain")  # a dry run is when one would want to know that the task would wait
    drained = server.cli("submit", "--dry-run", "--", "true")
    assert drained.stderr == "note: the server is draining: no placements until `carma resume`\n"
    server.cli("resume")
    refused = server.cli("submit", "--dry-run", "--gpus", "2", "--", "true")
    assert (refused.returncode, refused.stderr) == (2, "error: task 'true' needs 2 GPUs but this server has 1\n")
    assert server.json("queue", "--all") == []
    assert server.submit("true") == 1  # no id spent


def test_submitting_from_a_deleted_directory_is_one_line_or_takes_the_workdir_given(start_server, tmp_path):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB")
    gone = tmp_path / "gone"

    def submit_from_gone(*args: str) -> subprocess.CompletedProcess[str]:
        gone.mkdir()  # entered, then removed under the shell: os.getcwd() fails (it was a traceback)
        line = f'cd "{gone}" && rmdir "{gone}" && exec "{CARMA}" submit {" ".join(args)} -- true'
        return subprocess.run(["sh", "-c", line], env=server.env, capture_output=True, text=True, timeout=60)

    lost = submit_from_gone()
    assert (lost.returncode, lost.stderr) == (
        2,
        "error: the current directory no longer exists: cd into one, or give an absolute path\n",
    )
    assert submit_from_gone("--workdir", "/tmp").returncode == 0


def test_a_state_directory_too_deep_for_its_socket_is_refused_before_anything_is_made(tmp_path):
    """The bind failed with "AF_UNIX path too long", after the database and fake GPUs had been made."""
    home = tmp_path / ("x" * 100)
    started = run_carma("server", "--fake-gpus", "1xA100-40GB", env=cli_env(CARMA_HOME=str(home)))
    assert started.returncode == 2 and started.stderr.count("\n") == 1
    assert (
        f"the server's socket {home / 'carma.sock'} would be" in started.stderr
        and "shorter CARMA_HOME" in started.stderr
    )
    assert not home.exists()


def test_a_tcp_address_it_cannot_listen_on_is_named_in_one_line():
    home = Path(tempfile.mkdtemp(prefix="c", dir="/tmp"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for address, message in [  # were "Address already in use" and "Name or service not known", bare
            (f"127.0.0.1:{port}", f"cannot listen on 127.0.0.1:{port}: Address already in use"),
            (f"http://127.0.0.1:{port}", f"cannot read TCP address 'http://127.0.0.1:{port}'; write HOST:PORT"),
        ]:
            env = cli_env(CARMA_HOME=str(home), PATH=f"{Path(__file__).parent / 'bin'}:{os.environ['PATH']}")
            started = run_carma("server", "--fake-gpus", "1xA100-40GB", "--mps", "--tcp", address, env=env)
            assert started.returncode == 2 and started.stderr.startswith(f"error: {message}"), started.stderr
            assert not (home / "carma.sock").exists()  # the unix socket bound before it was left behind
            assert not (home / "mps" / "pipe" / "fake-control.pid").exists()  # MPS was started, and ran on
    shutil.rmtree(home)


def test_a_request_body_too_large_is_refused_before_it_is_read(start_server):  # type: ignore[no-untyped-def]
    """A body is read before its token is checked: anyone reaching the TCP port could fill the daemon's
    memory (300 MiB sent without a token took it to 970 MiB)."""
    port = free_port()
    server = start_server("--fake-gpus", "1xA100-40GB", "--tcp", f"127.0.0.1:{port}")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.putrequest("POST", "/v1/tasks")
    conn.putheader("Content-Length", str(1 << 30))
    conn.endheaders()  # and no body: the answer must not wait for it
    response = conn.getresponse()
    assert (response.status, response.getheader("Content-Type")) == (413, "application/json")  # was text/plain
    assert json.loads(response.read()) == {"detail": "the request is over 4 MiB"}
    conn.close()
    with pytest.raises(ClientError, match=r"^the request is larger than the server at .* takes \(HTTP 413\)$"):
        server.client.submit({"command": ["true"], "workdir": "/tmp", "env": {"X": "y" * (5 << 20)}})
    assert server.json("queue", "--all") == []


def test_users_cancel_and_read_only_their_own_tasks_over_tcp(start_server):  # type: ignore[no-untyped-def]
    home = Path(tempfile.mkdtemp(prefix="c", dir="/tmp"))
    # uids with accounts: a daemon run as root (as in CI containers) runs each task as its owner
    alice_uid, bob_uid = sorted(p.pw_uid for p in pwd.getpwall() if p.pw_uid != 0)[:2]
    tokens = (
        f"alice-token-0123456 alice {alice_uid}\nbob-token-0123456 bob {bob_uid}\n"
        "admin-token-0123456 ops 0 admin\nghost-token-0123456 x 4242\n"
    )
    (home / "tokens").write_text(tokens)
    (home / "tokens").chmod(0o600)
    (home / "carma.toml").write_text("[server]\nmax_user_tasks = 2\nmax_user_spec_mib = 1\n")
    port = free_port()
    server = start_server(
        "--fake-gpus", "1xA100-40GB", "--tcp", f"127.0.0.1:{port}", "--config", str(home / "carma.toml"), home=home
    )
    url = f"http://127.0.0.1:{port}"
    alice, bob, admin, nobody = (
        Client(url=url, token=t) for t in ("alice-token-0123456", "bob-token-0123456", "admin-token-0123456", "x")
    )
    admin.drain(True)  # keep the tasks waiting
    task = alice.submit({"command": ["true"], "workdir": "/tmp"})
    assert task["user"] == "alice"
    alice.submit({"command": ["true"], "workdir": "/tmp"})
    with pytest.raises(ClientError, match=r"alice has 2 tasks not ended, the most this server takes from one user"):
        alice.submit({"command": ["true"], "workdir": "/tmp"})  # each held its spec in memory: a loop filled it
    admin.submit({"command": ["true"], "workdir": "/tmp"})  # admins: no cap
    large = {f"V{i}": "x" * 120_000 for i in range(5)}  # 600 kB of environment: Linux passes up to 2 MB
    bob.submit({"command": ["true"], "workdir": "/tmp", "env": large})
    with pytest.raises(ClientError, match=r"bob's tasks not ended would hold 1.1 MiB of commands and environments"):
        bob.submit({"command": ["true"], "workdir": "/tmp", "env": large})  # 2 MB each: tens of GB at the task cap
    answers: list[str] = []

    def submit() -> None:  # at once: the caps are counted with nothing awaited before the task is taken
        try:
            answers.append(str(bob.submit({"command": ["true"], "workdir": "/tmp"})["id"]))
        except ClientError as e:
            answers.append(str(e))

    racing = [threading.Thread(target=submit) for _ in range(8)]
    for thread in racing:
        thread.start()
    for thread in racing:
        thread.join()
    assert sum(answer.isdigit() for answer in answers) == 1  # bob's second task; the rest over his cap of 2
    with pytest.raises(ClientError, match="belongs to alice, not to bob"):
        bob.cancel(task["id"])
    with pytest.raises(ClientError, match="belongs to alice"):
        bob.logs(task["id"])
    with pytest.raises(ClientError, match="only root or the daemon's owner"):
        bob.drain(False)
    with pytest.raises(ClientError, match="missing or unknown bearer token"):
        nobody.tasks()
    raw = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    raw.request("GET", "/v1/tasks", headers={"Authorization": "Bearer caf\xe9"})  # was a 500 and a traceback
    assert raw.getresponse().status == 401
    raw.close()
    with pytest.raises(ClientError, match=r"bearer token \(set CARMA_TOKEN to your token\)$"):
        Client(url=url, token="").tasks()
    assert bob.task(task["id"])["state"] == "queued"  # reading the queue is open to all
    assert bob.task(task["id"])["env"] is None  # but not what a task was given (tokens, keys)
    assert alice.task(task["id"])["env"] == {} and admin.task(task["id"])["env"] == {}
    with pytest.raises(ClientError, match=r"state must be one of queued, .*; got 'queud'"):
        bob.tasks(state="queud")
    if os.geteuid() == 0:
        with pytest.raises(ClientError, match=r"uid 4242 \(x\) has no account on this machine"):
            Client(url=url, token="ghost-token-0123456").submit({"command": ["true"], "workdir": "/tmp"})
    assert alice.cancel(task["id"])["state"] == "cancelled"
    (bobs,) = (int(answer) for answer in answers if answer.isdigit())
    assert admin.cancel(bobs)["state"] == "cancelled"  # admins may cancel anyone's
    via_cli = server.cli("queue", "--all", env={"CARMA_URL": url, "CARMA_TOKEN": "bob-token-0123456"})
    assert via_cli.returncode == 0 and "alice" in via_cli.stdout


# ----------------------------------------------------------------------------- recovery and crash safety


def test_an_oom_crashed_task_is_recovered_and_completes(start_server):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "50")
    big = server.submit(*fakejob(600, "30000MiB"))
    late = server.submit(*fakejob(200, "20000MiB"))
    follow = subprocess.Popen([CARMA, "logs", "-f", str(late)], env=server.env, stdout=PIPE, stderr=PIPE, text=True)
    waiting = wait_until(lambda: [t for t in server.json("queue") if t["state"] == "recovering"], 60, "recovery")
    assert [(t["id"], t["need"], t["need_source"]) for t in waiting] == [(late, "whole_gpu", "recovery")]
    assert server.cli("wait", big, late, "--timeout", "90").returncode == 0
    followed, said = follow.communicate(timeout=30)  # followed from the crashed attempt into its relaunch
    assert follow.returncode == 0 and "step 10/10" in followed
    *before, relaunched, ended = said.splitlines()  # before: a line saying it has not started, if it had not
    assert len(before) <= 1 and all(line.startswith(f"carma: task {late} has not started: ") for line in before)
    assert (relaunched, ended) == (
        f"carma: task {late} was relaunched: attempt 2's output follows",
        f"carma: task {late} completed",
    )
    attempts = server.task(late)["attempt_list"]
    assert server.task(late)["start_s"] == attempts[1]["dispatched_s"]  # queue's TIME: the relaunch's run
    assert [a["outcome"] for a in attempts] == ["oom", "success"]
    assert not attempts[0]["exclusive"] and attempts[1]["recovery"] and attempts[1]["exclusive"]
    assert "CUDA out of memory" in attempts[0]["message"]
    assert "CUDA out of memory" in server.cli("logs", late, "--stderr", "--attempt", "1").stdout
    latest = server.cli("logs", late, "--stderr")  # the relaunch's: it says where the crash's output is
    assert "CUDA out of memory" not in latest.stdout
    assert latest.stderr == f"carma: task {late} was relaunched: this is attempt 2's output (--attempt 1: before)\n"
    shown = server.cli("show", late).stdout
    # no earlier run of its command: the default estimator, history, found nothing
    assert (
        "attempt 1 on GPU 0 (collocated, oom; need unknown: recovery only (history: no earlier successful run of "
        "this command))"
    ) in shown
    assert "attempt 2 on GPU 0 (recovery, alone, success; need whole GPU from recovery)" in shown


def test_a_log_of_several_chunks_is_printed_whole(start_server):  # type: ignore[no-untyped-def]
    """The API sends a log 1 MiB at a time, cut between UTF-8 characters: `carma logs` printed the first
    chunk only, and `-f` stopped there once a line held a character of two bytes."""
    server = start_server("--fake-gpus", "1xA100-40GB")
    lines = 150_000
    task = server.submit(sys.executable, "-c", f"for i in range({lines}): print(f'ligne é {{i:07d}}')")
    assert server.cli("wait", task, "--timeout", "60").returncode == 0
    expected = "".join(f"ligne é {i:07d}\n" for i in range(lines))  # 2.5 MiB
    assert server.cli("logs", task).stdout == expected
    assert server.cli("logs", task, "-f").stdout == expected


def test_a_hangup_stops_the_daemon_cleanly_and_the_task_runs_on(start_server):  # type: ignore[no-untyped-def]
    """The terminal of a `carma server &` closing killed it at once: no stop, no observations saved."""
    if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:  # inherited: the daemon keeps nohup's choice
        pytest.skip("the tests run with SIGHUP ignored (under nohup), which the daemon rightly keeps")
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "50")
    task = server.submit(*fakejob(300))
    server.wait_state(task, "running")
    server.proc.send_signal(signal.SIGHUP)
    assert server.proc.wait(timeout=30) == 0
    assert "carma server stopped; running tasks continue" in (server.home / "test-server.log").read_text()
    server.start()
    assert server.cli("wait", task, "--timeout", "60").returncode == 0


def test_a_daemon_started_under_nohup_outlives_a_hangup(start_server):  # type: ignore[no-untyped-def]
    """Its own SIGHUP handler replaced the one nohup leaves ignored: a `nohup carma server &` stopped at the
    logout nohup is for."""
    server = start_server("--fake-gpus", "1xA100-40GB", launcher=("nohup",))
    server.proc.send_signal(signal.SIGHUP)
    time.sleep(2)
    assert server.proc.poll() is None and server.cli("status").returncode == 0


def test_killing_the_daemon_loses_no_task_and_runs_none_twice(start_server):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "2xA100-40GB", "--time-scale", "100")
    durations = [150, 300, 900, 200, 1500, 150]
    ids = [server.submit(*fakejob(d, "6GiB")) for d in durations]
    running = wait_until(lambda: [t for t in ids if server.task(t)["state"] == "running"], 30, "running tasks")
    long_one = max(running, key=lambda t: durations[ids.index(t)])
    log_before = len(server.cli("logs", long_one).stdout)
    server.kill9()
    time.sleep(3)  # some tasks end while no daemon watches
    server.start()
    assert server.cli("wait", *ids, "--timeout", "120").returncode == 0
    for task_id in ids:
        outcomes = [a["outcome"] for a in server.task(task_id)["attempt_list"]]
        assert outcomes.count("success") == 1 and outcomes[-1] == "success", (task_id, outcomes)
        run_dirs = list((server.home / "tasks" / str(task_id)).iterdir())
        assert len(run_dirs) == len(outcomes)  # every attempt the daemon knows of, and no other process
    assert len(server.cli("logs", long_one).stdout) > log_before  # the re-adopted task's log kept growing


def test_a_failing_scheduling_loop_stops_the_server_saying_why(start_server, tmp_path):  # type: ignore[no-untyped-def]
    """Once, a launch error ended the loop unseen: the API kept answering and nothing was placed again."""
    (tmp_path / "sitecustomize.py").write_text(
        "import carma.server.daemon as d\n"
        "def step(self):\n"
        "    raise RuntimeError('a bug in a step')\n"
        "d.Daemon.step = step\n"
    )
    home = Path(tempfile.mkdtemp(prefix="c", dir="/tmp"))
    try:
        env = cli_env(CARMA_HOME=str(home), PYTHONPATH=str(tmp_path))
        ended = subprocess.run([CARMA, "server", "--fake-gpus", "1xA100-40GB"], env=env, capture_output=True, text=True,
                               timeout=60)  # fmt: skip
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert ended.returncode == 1
    assert "the scheduling loop failed; the server stops" in ended.stderr
    assert "RuntimeError: a bug in a step" in ended.stderr


# ----------------------------------------------------------------------------- against the twin


def test_a_30_task_replay_matches_the_twin(start_server):  # type: ignore[no-untyped-def]
    """30 tasks of CARMA's trace 1 at 200x on 3 fake A100s, MAGM, with their memory declared.

    Tolerance: makespan within 10% of the twin's for the same tasks. The gap is wall time the twin does not
    have, multiplied by the time scale: the scheduling steps lag, and a burst of launches queues on busy cores.
    Declared needs, not recovery only: there, whether a two-GPU task crashes beside a co-runner depends on the
    order in which allocations land, which a stall of the machine decides, and one crash more (gpt2_large_2,
    whose relaunch waits for two idle GPUs) made the clean-clone CI +10% to +11% three times in five.
    """
    server = start_server("--fake-gpus", "3xA100-40GB", "--time-scale", "200")
    result = server.cli("replay", "carma-t1", "--limit", "30", "--memory", "oracle", "--wait", "--json")
    assert result.returncode == 0, result.stderr
    replayed = json.loads(result.stdout)
    figures = replayed["figures"]
    trace = load_trace("carma-t1", load_catalog())
    twin = simulate(Trace("t1-30", trace.entries[:30]), RunConfig("magm", "oracle")).metrics
    assert figures["completed"] == 30 and figures["failed"] == 0
    assert figures["collocated_attempts"] > 10  # MAGM collocated
    gap = figures["makespan_s"] / twin.makespan_s - 1
    assert abs(gap) < 0.10, f"{gap:+.1%}: {json.dumps(figures)}; twin {twin}\n{_story(server, replayed['ids'])}"
    assert figures["oom_crashes"] == twin.oom_crashes == 0


def _story(server, ids) -> str:  # type: ignore[no-untyped-def]
    """Each replayed task's attempts, for a failure's message: waits, first kernels seen, outcomes."""
    lines = []
    for task_id in ids:
        task = server.json("show", task_id)
        for a in task["attempt_list"]:
            seen = f"+{a['first_kernel_s'] - a['dispatched_s']:.0f} s" if a["first_kernel_s"] else "never"
            lines.append(
                f"{task_id} {task['name']} #{a['number']}: waited {a['dispatched_s'] - task['submit_s']:.0f} s, "
                f"first kernel {seen}, ended +{(a['ended_s'] or 0) - a['dispatched_s']:.0f} s, {a['outcome']} "
                f"{a['message'][:80]}"
            )
    return "\n".join(lines)


def test_a_replay_declares_run_times_and_its_twin_mirrors_carmas_own_decisions(start_server, tmp_path):  # type: ignore[no-untyped-def]
    config = tmp_path / "carma.toml"
    config.write_text("[scheduler]\nttfk_unknown_only = true\nwarmup_risk = true\nbackfill = true\n")
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "400", "--config", str(config))
    trace = tmp_path / "two.yaml"
    trace.write_text("name: two\ntasks:\n  - {at: 0, task: mobilenet}\n  - {at: 0, task: vgg}\n")
    result = server.cli("replay", trace, "--memory", "oracle", "--duration", "oracle", "--wait", "--json")
    assert result.returncode == 0, result.stderr
    replayed = json.loads(result.stdout)
    catalog = load_catalog()
    declared = [server.json("show", i)["duration_s"] for i in replayed["ids"]]
    assert declared == [catalog["mobilenet"].solo_s, catalog["vgg"].solo_s]
    twin = "MAGM oracle, activity from history, open warm-ups, warm-up risk, backfilling on "
    assert replayed["twin"]["config"].startswith(twin)  # the twin learns activity as the server, not from profiles
    assert "backfills knowing" not in result.stderr  # no note: the server knew the run times too


def test_a_replay_whose_task_was_cancelled_counts_it_and_exits_1(start_server, tmp_path):  # type: ignore[no-untyped-def]
    """The cancelled task was in no figure and the replay exited 0, as if the run had completed."""
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "400")
    trace = tmp_path / "two.yaml"
    trace.write_text("name: two\ntasks:\n  - {at: 0, task: vgg}\n  - {at: 0, task: vgg}\n")
    replay = subprocess.Popen([CARMA, "replay", trace, "--wait", "--json"], env=server.env, stdout=PIPE, stderr=PIPE,
                              text=True)  # fmt: skip
    # cancelled as soon as it exists, queued or already placed (at 400x its time in the queue is a blink)
    wait_until(lambda: any(t["id"] == 2 for t in server.client.tasks(all=True)), 60, "the second submission")
    assert server.cli("cancel", 2).returncode == 0
    stdout, _ = replay.communicate(timeout=120)
    figures = json.loads(stdout)["figures"]
    assert (replay.returncode, figures["completed"], figures["cancelled"]) == (1, 1, 1)


def test_a_replay_cut_short_says_which_tasks_it_had_submitted(start_server, tmp_path):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "400")
    trace = tmp_path / "two.yaml"
    trace.write_text("name: two\ntasks:\n  - {at: 0, task: vgg}\n  - {at: 2000, task: nonesuch}\n"
                     "  - {at: 2000, task: vgg}\n")  # fmt: skip
    replay = subprocess.Popen([CARMA, "replay", trace, "--skip-unknown"], env=server.env, stderr=subprocess.PIPE,
                              text=True)  # fmt: skip
    assert replay.stderr is not None
    assert replay.stderr.readline() == "skipped 1 entry of unknown tasks: nonesuch\n"
    submitted = re.fullmatch(r"t=0s submitted task (\d+) \(vgg\)\n", replay.stderr.readline())
    assert submitted
    replay.send_signal(signal.SIGINT)  # before the second submission, 5 s of wall time later
    assert replay.wait(timeout=60) == 130
    assert replay.stderr.read() == f"error: interrupted (submitted 1 of 2 tasks: {submitted[1]})\n"


def test_a_replay_waits_out_a_restart_of_the_server(start_server, tmp_path):  # type: ignore[no-untyped-def]
    """A server restarted during a replay (an upgrade) stopped it at its next submission, the rest of the trace
    never submitted; a server that is not answering is waited for, as `carma wait` does."""
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "400")
    trace = tmp_path / "three.yaml"
    trace.write_text("name: three\ntasks:\n  - {at: 0, task: vgg}\n  - {at: 1200, task: vgg}\n"
                     "  - {at: 1600, task: vgg}\n")  # fmt: skip
    replay = subprocess.Popen([CARMA, "replay", trace, "--wait", "--json"], env=server.env, stdout=PIPE, stderr=PIPE,
                              text=True)  # fmt: skip
    wait_until(lambda: len(server.json("queue", "--all")) == 1)
    server.stop()  # the second submission, 3 s of wall time later, finds no server
    time.sleep(5)
    server.start()
    stdout, stderr = replay.communicate(timeout=120)
    assert replay.returncode == 0, stderr
    result = json.loads(stdout)
    assert (result["ids"], result["figures"]["completed"]) == ([1, 2, 3], 3)
    said = "carma: the server stopped answering; going on with the replay at three.yaml, task 2 when it is back\n"
    assert stderr.count(said) == 1


# ----------------------------------------------------------------------------- MPS and history


def test_mps_clients_get_carmas_pipe_and_their_limits(start_server):  # type: ignore[no-untyped-def]
    stand_in = str(Path(__file__).parent / "bin")
    server = start_server("--fake-gpus", "1xA100-40GB", "--mps", env={"PATH": f"{stand_in}:{os.environ['PATH']}"})
    assert server.json("status")["mps"]
    show_env = ["sh", "-c", "env | grep ^CUDA_MPS | sort"]
    limited = server.submit(*show_env, mem="4GiB", **{"mps-threads": 50})
    plain = server.submit(*show_env)
    server.cli("wait", limited, plain)
    pipe = server.home / "mps" / "pipe"
    assert server.cli("logs", limited).stdout.splitlines() == [
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50",
        f"CUDA_MPS_LOG_DIRECTORY={server.home / 'mps' / 'log'}",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=6144M",  # the 4 GiB need plus the 2 GiB margin
        f"CUDA_MPS_PIPE_DIRECTORY={pipe}",
    ]
    assert "PINNED" not in server.cli("logs", plain).stdout  # no known need, no limit
    assert server.cli("mps", "stop").returncode == 0


def test_history_records_what_the_gpus_saw_of_a_run(start_server):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "50")
    empty = server.cli("history", "--hours", "1")  # a header alone read as a listing that failed
    assert (empty.returncode, empty.stderr) == (0, "no run ended in the last 1 h\n")
    task_id = server.submit(*fakejob(200, "3GiB", "--smact", "0.4", "--smocc", "0.2", "--drama", "0.3"), mem="4GiB")
    waited = server.cli("wait", task_id, task_id)
    assert (waited.returncode, waited.stdout) == (0, f"task {task_id} completed\n")  # a repeated id said once
    (run,) = server.json("history")
    assert (run["task_id"], run["attempt"], run["outcome"], run["peak_mib"]) == (task_id, 1, "success", 3072)
    assert run["gpus"] == [0]  # as `carma gpus` names it (it was the GPU's UUID)
    assert (run["need_mib"], run["need_source"]) == (4096, "user")  # what it was placed with, beside its peak
    assert run["smact_mean"] == pytest.approx(0.4, abs=0.05)  # alone on its GPU, its own SMACT
    assert run["exec_s"] > 150
    table = server.cli("history")
    header, row = (re.split(r"\s{2,}", line.strip()) for line in table.stdout.splitlines()[:2])
    shown = dict(zip(header, row, strict=True))
    assert table.returncode == 0
    assert (shown["PEAK"], shown["PLACED WITH"], shown["FROM"]) == ("3.00 GiB", "4.00 GiB", "user")
    later = server.submit("true")
    assert server.cli("wait", later).returncode == 0
    newest = server.cli("history", "-n", "1")  # years of runs: the newest unless asked for more
    assert [line.split()[0] for line in newest.stdout.splitlines()[1:]] == [f"{later}.1"]
    assert newest.stderr == "the newest 1 run; --limit for more\n"
    assert [r["task_id"] for r in server.json("history", "--limit", "2")] == [task_id, later]  # oldest first


def test_ended_tasks_are_forgotten_after_the_configured_days(start_server, tmp_path):  # type: ignore[no-untyped-def]
    config = tmp_path / "carma.toml"
    config.write_text("[server]\nkeep_ended_days = 0.01  # 864 s of the daemon's clock: 4.3 s at 200x\n")
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "200", "--config", str(config))
    done, slow = server.submit("true"), server.submit("sleep", "7")  # wall seconds: outlives the retention
    waited = server.cli("wait", done, slow)  # the first is forgotten while the second runs: not an error
    assert waited.returncode == 0, waited.stderr
    gone = wait_until(lambda: (r := server.cli("show", done)).returncode != 0 and r, 30, "the task to be forgotten")
    assert gone.stderr.strip() == (
        f"error: no task with id {done}: it ended over 0.01 day(s) ago and was forgotten ([server] keep_ended_days)"
    )
    assert not (server.home / "tasks" / str(done)).exists()
    # beyond 20 ids wait reads the listing, which has no reason to give; the first missing id is the one asked
    many = server.cli("wait", done, *range(slow + 1, slow + 21))
    assert many.returncode == 2 and "was forgotten ([server] keep_ended_days)" in many.stderr
    assert server.submit("true") == slow + 1


def test_the_first_lines_say_how_clients_reach_a_home_given_and_that_twin_settings_are_not_the_servers(
    start_server, tmp_path
):  # type: ignore[no-untyped-def]
    """Clients find the daemon through $CARMA_HOME only; and [twin] (gpus, sharing) was silently ignored."""
    config = tmp_path / "carma.toml"
    config.write_text('[twin]\nsharing = "timeslice"\n')
    home = Path(tempfile.mkdtemp(prefix="c", dir="/tmp"))
    options = ("--fake-gpus", "1xA100-40GB", "--home", str(home), "--config", str(config))
    server = start_server(*options, home=home, env={"CARMA_HOME": str(tmp_path / "elsewhere")})
    server.stop()
    log = (home / "test-server.log").read_text()
    assert f"; clients reach it with CARMA_HOME={home}\n" in log
    assert f"warning: {config}: [twin] is for carma simulate; the server's fake GPUs are --fake-gpus" in log
    shutil.rmtree(home)


def test_a_replay_longer_than_the_retention_still_gives_its_figures(start_server, tmp_path):  # type: ignore[no-untyped-def]
    """The figures were read after the wait, each task asked again: the first, forgotten by then, stopped it."""
    config = tmp_path / "carma.toml"
    config.write_text("[server]\nkeep_ended_days = 0.01\n")  # 864 s of the daemon's clock
    trace = tmp_path / "two.csv"
    trace.write_text("submit_s,task,solo_s,mem_mib\n0,short,60,1024\n3000,short,60,1024\n")
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "600", "--config", str(config))
    result = server.cli("replay", trace, "--wait", "--json")
    assert result.returncode == 0, result.stderr
    first = json.loads(result.stdout)["ids"][0]
    assert server.cli("show", first).returncode == 2  # forgotten before the second ended
    assert json.loads(result.stdout)["figures"]["completed"] == 2


def test_a_replayed_task_the_server_refuses_stops_the_replay_before_any_submission(start_server, tmp_path):  # type: ignore[no-untyped-def]
    """The two-GPU task, 2 hours into the trace, was found 18 s of wall time in, with the first task running."""
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "400")
    (tmp_path / "t.csv").write_text("submit_s,task,gpus,solo_s,mem_mib\n0,vgg,,,\n7200,xlnet_large_cased_2,,,\n"
                                    "7300,huge,1,600,50GiB\n")  # fmt: skip
    result = server.cli("replay", tmp_path / "t.csv")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "error: t.csv, line 3: task 'xlnet_large_cased_2' needs 2 GPUs but this server has 1 (submitted 0 of 3 tasks)"
    ]
    assert server.json("queue", "--all") == []
    (tmp_path / "t.csv").write_text("submit_s,task,gpus,solo_s,mem_mib\n0,vgg,,,\n7300,huge,1,600,50GiB\n")
    oracle = server.cli("replay", tmp_path / "t.csv", "--memory", "oracle")
    assert (oracle.returncode, oracle.stderr.splitlines()) == (2, [
        "error: t.csv, line 3: task 'huge' needs 50.00 GiB of GPU memory per GPU, more than any GPU of this "
        "server has (40.00 GiB) (submitted 0 of 2 tasks)"
    ])  # fmt: skip
    assert server.json("queue", "--all") == []
    (tmp_path / "t.csv").write_text("submit_s,task,gpus,solo_s,mem_mib\n0,huge,1,600,50GiB\n")
    unknown = server.cli("replay", tmp_path / "t.csv")  # recovery only: replayed, as a job bound to fail
    assert unknown.returncode == 0
    assert unknown.stderr.splitlines()[0] == (
        "warning: t.csv, line 2: task 'huge' needs 50.00 GiB of GPU memory per GPU, more than any GPU of this "
        "server has (40.00 GiB): replayed without its need, it will run out of memory"
    )
    assert [t["name"] for t in server.json("queue", "--all")] == ["huge"]


def test_estimate_none_opts_a_task_out_of_the_servers_default_estimator(start_server):  # type: ignore[no-untyped-def]
    server = start_server("--fake-gpus", "1xA100-40GB", "--time-scale", "50")
    first = server.submit(*fakejob(5, "3GiB"))
    assert server.cli("wait", first).returncode == 0
    again = server.submit(*fakejob(5, "3GiB"), estimate="none")  # history would give it 3 GiB and more
    shown = server.json("show", again)
    assert shown["estimate"] is None and shown["need"] == "unknown"
    defaulted = server.submit(*fakejob(5, "3GiB"))
    assert server.json("show", defaulted)["estimate"] == "history"
