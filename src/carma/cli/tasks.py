"""The daemon's client commands: submit, queue, show, logs, cancel, wait, gpus, status, drain, resume."""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from carma.cli.common import (
    PATH_VALUE,
    UsageError,
    absolute,
    app,
    clipped,
    columns,
    err,
    error_line,
    fail,
    out,
    positive,
)
from carma.textfiles import NotText, load_yaml, read_text, yaml_problem
from carma.units import in_unit, parse_mib, parse_seconds, pluralize, size_text, time_unit

if TYPE_CHECKING:
    from carma.server.client import Client

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")]
HISTORY_RUNS = 1000  # the newest runs `carma history` shows without --limit
TASK_FILE_KEYS = {"name", "command", "workdir", "gpus", "mem", "estimate", "duration", "env", "shell", "mps_threads"}


def _client() -> Client:
    from carma.server.client import Client, ClientError

    try:
        return Client()
    except ClientError as e:  # a CARMA_URL it cannot use
        raise fail(e) from None


def _call(fn, *args: Any, **kwargs: Any) -> Any:  # type: ignore[no-untyped-def]
    """`fn`'s answer; a refusal or a server down exits 2, a server down past a restart's minute (GaveUp) 3."""
    from carma.server.client import ClientError, GaveUp

    try:
        return fn(*args, **kwargs)
    except GaveUp as e:
        raise fail(e, code=3) from None
    except ClientError as e:
        raise fail(e) from None


def _print_json(value: object) -> None:
    print(json.dumps(value))


def _spec_from_file(path: Path) -> dict[str, Any]:
    import yaml  # here: only `submit -f` reads YAML, and every command pays for a top-level import

    stdin = str(path) == "-"
    where = "standard input" if stdin else str(path)
    try:
        doc = load_yaml(read_text(Path("/dev/stdin"), where) if stdin else read_text(path))
    except FileNotFoundError:
        raise fail(f"no task file {str(path)!r}") from None
    except NotText as e:
        raise fail(e) from None
    except OSError as e:  # a directory, say
        raise fail(f"cannot read task file {str(path)!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise fail(f"{where}: not valid YAML ({yaml_problem(e)})") from None
    if not isinstance(doc, dict):
        toml = " (task files are YAML; carma's configuration file is the TOML one)" if path.suffix == ".toml" else ""
        raise fail(f"{where}: a task file is a YAML mapping with at least 'command'{toml}")
    unknown = set(doc) - TASK_FILE_KEYS
    if unknown:
        raise fail(f"{where}: unknown key(s) {', '.join(sorted(map(str, unknown)))}")
    spec = dict(doc)
    if isinstance(spec.get("command"), str):  # split as the shell would, quotes and all
        spec["command"] = [spec["command"]] if spec.get("shell") is True else _split(spec["command"], where)
    if not spec.get("command"):  # the server's own words ("Field required") would not name the file
        raise fail(f"{where}: 'command' is missing or empty")
    if not isinstance(spec["command"], list):  # the server's "should be a valid list" hid that a line is taken
        quote = " (YAML reads true and false as booleans: quote the program's name)" * (type(spec["command"]) is bool)
        raise fail(f"{where}: command must be a command line or a list of arguments, not {spec['command']!r}{quote}")
    if not isinstance(spec.get("workdir") or "", str):
        raise fail(f"{where}: workdir must be a path, not {spec['workdir']!r}")
    # relative to the file's folder, by default that; to the current one for standard input or a pipe (<(...))
    base = path.parent if not stdin and path.is_file() else Path()
    given = Path(spec.get("workdir") or ".").expanduser()
    spec["workdir"] = str(given if given.is_absolute() else absolute(base / given))
    return spec


def _split(command: str, where: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError as e:  # an unclosed quote
        raise fail(f"{where}: cannot split command {command!r}: {e}") from None


@app.command("submit", context_settings={"allow_interspersed_args": False})
def submit_cmd(
    command: Annotated[list[str] | None, typer.Argument(help="The command and its arguments (after --).")] = None,
    file: Annotated[
        Path | None,
        typer.Option(
            "--file", "-f", help="A task file (YAML; - reads standard input) instead of a command.", **PATH_VALUE
        ),
    ] = None,
    gpus: Annotated[int | None, typer.Option(help="GPUs the task needs (default 1).")] = None,
    mem: Annotated[
        str | None,
        typer.Option(
            help="GPU memory it needs on each of its GPUs, with a unit: 8GiB or 8G (8 x 1024^3 bytes), 8GB (8 x 10^9)."
            " Unknown: recovery only."
        ),
    ] = None,
    estimate: Annotated[
        str | None,
        typer.Option(
            help="Or estimate it first: xmem, faketensor, horus, gpumemnet or history; none: recovery only "
            "(default: the server's, history)."
        ),
    ] = None,
    duration: Annotated[
        str | None,
        typer.Option(
            help="The run time you expect (not a limit), e.g. 2h, 90min, 1h30m: backfilling may start the task "
            "where it ends in time (default: its command's earlier runs)."
        ),
    ] = None,
    name: Annotated[str | None, typer.Option(help="A name for the queue (default: the program's).")] = None,
    workdir: Annotated[
        Path | None, typer.Option(help="Working directory (default: the current one).", **PATH_VALUE)
    ] = None,
    env: Annotated[list[str] | None, typer.Option(help="Environment variable K=V (repeatable).")] = None,
    shell: Annotated[bool, typer.Option(help="Run the command through /bin/sh (one command line).")] = False,
    clean_env: Annotated[
        bool, typer.Option("--clean-env", help="Give the task only --env (or the file's env), not your environment.")
    ] = False,
    mps_threads: Annotated[
        int | None, typer.Option(help="Under MPS: the task's share of the SMs in percent (1-100).")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Ask the server whether it would take the task; submit nothing.")
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """Submit a training task: a command after --, or a task file (-f).

    `carma submit --gpus 1 --mem 8GiB -- python train.py` or `carma submit -f task.yaml` (whose values the
    options override, as sbatch's options do its #SBATCH lines)."""
    if file and command:
        raise fail("give either a command (after --) or a task file (-f), not both")
    if mem is not None:
        try:  # here, not by the server, which reads a number as MiB, as task files and the API document
            parse_mib(mem, bare_mib=False)
        except ValueError as e:
            raise fail(f"--mem {e}") from None
    variables = {}
    for item in env or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise fail(f"--env takes KEY=VALUE, got {item!r}")
        variables[key] = value
    given = {
        "gpus": gpus,
        "mem": mem,
        "estimate": estimate,
        "duration": duration,
        "name": name,
        "workdir": str(absolute(workdir)) if workdir else None,
        "mps_threads": mps_threads,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if file:
        if shell:
            raise fail("--shell applies to a command after --; a task file says `shell: true`")
        spec = _spec_from_file(file)
        if "mem" in given or "estimate" in given:  # one memory need replaces the other
            spec.pop("mem", None)
            spec.pop("estimate", None)
        spec.update(given)
        if variables and isinstance(spec.get("env") or {}, dict):  # added to the file's (a bad one: the server says)
            spec["env"] = {**(spec.get("env") or {}), **variables}
    elif command:
        spec = {
            "command": [" ".join(command)] if shell else command,
            "workdir": given.get("workdir") or str(absolute()),
            **given,
            "env": variables,
            "shell": shell,
        }
    else:
        raise fail("nothing to run: give a command after --, or a task file with -f")
    if not clean_env and isinstance(spec.get("env") or {}, dict):
        from carma.server.spec import inherited_env, undecodable

        spec["env"] = {**inherited_env(os.environ), **(spec.get("env") or {})}
        if left_out := [k for k in undecodable(os.environ) if k not in spec["env"]]:
            err.print(f"note: not passed to the task, their values are not UTF-8 text: {', '.join(left_out)}")
    spec = {k: v for k, v in spec.items() if v is not None}
    if isinstance(spec.get("duration"), str):  # read here: the server's schema would only quote its pattern
        try:
            parse_seconds(spec["duration"])
        except ValueError as e:
            raise fail(f"{'--duration' if duration is not None else 'duration'}: {e}") from None
    from carma.server.client import DRAINING

    if dry_run:  # as sbatch --test-only: the same checks, and a refusal the same error
        checked = _call(_client().check, spec)
        if as_json:
            _print_json(checked)
            return
        out.print(f"the server would take task {checked['name']!r}; nothing was submitted", highlight=False)
        if checked.get("draining"):  # none from a daemon before an upgrade
            err.print(f"note: {DRAINING}")
        return
    task = _call(_client().submit, spec)
    if as_json:
        _print_json({"id": task["id"]})
    else:
        out.print(f"submitted task {task['id']} ({task['name']})" + _need_said(task))
        if task["waiting_reason"] == DRAINING:  # easily missed: the task would wait without a word
            err.print(f"note: {DRAINING}")


def _need_said(task: dict[str, Any]) -> str:
    """The memory need as the server read it, so that 8GB (7.45 GiB) is not taken for 8 GiB unseen."""
    if not task.get("mem_mib"):
        return ""
    each = " on each of its GPUs" if task["gpus_requested"] > 1 else ""
    return f": needs {size_text(task['mem_mib'] * 2**20)} of GPU memory{each}"


def _age(seconds: float | None, now: float) -> str:
    if seconds is None:
        return ""
    s = max(0, int(now - seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


@app.command("queue")
def queue_cmd(
    all: Annotated[bool, typer.Option("--all", "-a", help="Include tasks that ended.")] = False,
    state: Annotated[str | None, typer.Option(help="Only tasks in this state.")] = None,
    as_json: JsonOption = False,
) -> None:
    """List tasks, like squeue: waiting and running ones (with --all, ended ones too)."""
    client = _client()
    tasks = _call(client.tasks, all=all, state=state)
    if as_json:
        _print_json(tasks)
        return
    status = _call(client.status)
    now = status["clock_s"]
    rows = []
    for t in tasks:
        running = t["state"] in ("dispatched", "running")
        started = t["start_s"] if running else t["submit_s"]
        rows.append(
            [
                str(t["id"]),
                clipped(t["name"]),
                t["user"],
                t["state"],
                str(t["gpus_requested"]),  # a count: indices here read as a count ("2" for GPU 2)
                _need_text(t),
                ",".join(map(str, t["gpus"])) if running else "-",
                _age(started, t["ended_s"] or now),
                t["waiting_reason"] or t["activity"] or t["reason"] or "",
            ]
        )
    print(columns(("ID", "NAME", "USER", "STATE", "GPUS", "MEMORY", "ON", "TIME", "REASON"), rows))
    if status["time_scale"] != 1:
        err.print(f"note: TIME is simulated: {_scaled(status['time_scale'])}", highlight=False)


def _scaled(scale: float) -> str:
    """What --time-scale does to the times the server shows."""
    return f"the server runs {scale:g}x faster than the wall clock (--time-scale {scale:g})"


def _need_text(task: dict[str, Any]) -> str:
    """The memory a task is (or will be) placed with, as `carma queue`, `carma history` and the dashboard
    show it."""
    if task["need"] is None:
        if task.get("estimate") == "history" and task.get("state") == "queued":
            return "history"  # read from its command's earlier runs when it is placed: nothing is pending
        return f"{task['estimate']} pending" if task.get("estimate") and task.get("state") == "queued" else "-"
    if task["need"] == "known":
        gpus = task.get("gpus_requested") or len(task.get("gpus") or ())  # a history row: the GPUs it ran on
        return size_text(task["need_mib"] * 2**20) + ("/GPU" if gpus > 1 else "")
    return _kind_text(task["need"])


def _kind_text(need: str) -> str:
    """A need not known in MiB: a whole GPU, or unknown (recovery only)."""
    return "whole GPU" if need == "whole_gpu" else "unknown"


@app.command("show")
def show_cmd(task_id: int, as_json: JsonOption = False) -> None:
    """Show one task: its spec, state and every attempt."""
    task = _call(_client().task, task_id)
    if as_json:
        _print_json(task)
        return
    shell = " (shell)" if task["shell"] else ""
    command = task["command"][0] if task["shell"] else shlex.join(task["command"])
    lines = [
        f"task {task['id']}: {task['name']} ({task['user']}) is {task['state']}",
        f"command: {_escaped(command)}{shell}",
        f"workdir: {_escaped(task['workdir'])}; GPUs: {task['gpus_requested']}; memory need: " + _declared_need(task),
    ]
    if task.get("duration_s"):
        unit = time_unit(task["duration_s"])
        lines.append(f"expected run time: {in_unit(task['duration_s'], unit)} {unit[1]} (declared)")
    lines += _estimate_lines(task["memory_estimate"])
    if task["waiting_reason"]:
        lines.append(f"waiting: {task['waiting_reason']}")
    if task["activity"]:
        lines.append(f"now: {task['activity']}")
    if task["reason"]:
        lines.append(f"reason: {task['reason']}")
    for a in task["attempt_list"]:
        how = ("recovery, " if a["recovery"] else "") + ("collocated" if a["shared"] else "alone")
        end = f", {a['outcome']}" if a["outcome"] else ""
        need = f"{a['need_mib']} MiB" if a["need_mib"] else _kind_text(a["need"])
        source = f" from {a['need_source']}"
        if a["need"] == "unknown":  # not "from none"; an estimator that found nothing in brackets
            source = ": recovery only" + (f" ({a['need_source']})" if a["need_source"] not in (None, "none") else "")
        lines.append(
            f"attempt {a['number']} on GPU {','.join(map(str, a['gpus']))} ({how}{end}; need {need}{source}) "
            f"{a['message']}".rstrip()
        )
        if a.get("instance"):  # none from a daemon before dynamic MIG
            lines.append(f"  on MIG instance {a['instance']}: {_why_instance(a)}")
    out.print("\n".join(lines), highlight=False, markup=False)


def _why_instance(attempt: dict) -> str:  # type: ignore[type-arg]
    """Why a task ran on the instance it did (`carma.core.mig.placer`'s rule, in words)."""
    if attempt["recovery"]:
        return "the next larger profile after it ran out of memory on a smaller one (or its need, if larger)"
    if attempt["need_mib"]:
        return "the tightest profile holding its need and the margin"
    return "the tightest profile holding the [mig] min_mib a task of unknown need starts with"


def _escaped(text: str) -> str:
    """Text another user wrote, safe for a terminal: control characters (new lines, escape sequences) as
    Python escapes."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _estimate_lines(estimate: dict[str, Any] | None) -> list[str]:
    """The estimate the task's placement uses: its peak, where it goes, and the capture's notes."""
    if not estimate:
        return []
    parts = ", ".join(f"{part.replace('_', ' ')} {size_text(n)}" for part, n in estimate["breakdown"].items())
    head = f"estimate: {size_text(estimate['peak_bytes'])} by {estimate['method']} for {estimate['device']}"
    return [f"{head} in {estimate['seconds']:.1f} s ({parts})", *(f"note: {n}" for n in estimate.get("notes", []))]


def _declared_need(task: dict[str, Any]) -> str:
    if task["mem_mib"]:
        return f"{task['mem_mib']} MiB" + (" per GPU" if task["gpus_requested"] > 1 else "")
    if task["estimate"]:
        source, failed = task.get("need_source") or "", f"{task['estimate']} failed: "
        if source.startswith(failed):  # else said only on the attempt, once it ran
            return f"estimated by {task['estimate']}, which failed ({source.removeprefix(failed)}): recovery only"
        return f"estimated by {task['estimate']}"
    return "unknown (recovery only)"


@app.command("logs")
def logs_cmd(
    task_id: int,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing as the log grows.")] = False,
    stderr: Annotated[bool, typer.Option("--stderr", help="The error stream instead of stdout.")] = False,
    attempt: Annotated[int | None, typer.Option(help="An earlier attempt's log (default: the latest).", min=1)] = None,
) -> None:
    """Print a task's output; with -f, follow it, into the relaunches after an out-of-memory crash.

    All of it, chunk by chunk; following the latest attempt goes on to the attempts that relaunch it, and
    through a restart of the server (for up to a minute: exit 3 if it gave up)."""
    from carma.server.client import through_restarts

    client = _client()
    stream, offset, number = "stderr" if stderr else "stdout", 0, attempt
    chunk = _call(client.logs, task_id, stream, number, offset)  # a server not running is an error at once
    if chunk["attempt"] is None:  # an empty answer alone reads as a task that printed nothing
        err.print(f"carma: task {task_id} {_not_started(_call(client.task, task_id), follow)}", highlight=False)
    while True:
        if number is None and (latest := chunk["attempt"] or 0) > 1:  # the earlier output (an OOM, say) is elsewhere
            earlier = "--attempt 1" if latest == 2 else f"--attempt 1 to {latest - 1}"
            err.print(f"carma: task {task_id} was relaunched: this is attempt {latest}'s output ({earlier}: before)")
        number = number or chunk["attempt"]
        sys.stdout.write(chunk["text"])
        sys.stdout.flush()
        offset = chunk["offset"]
        if chunk["done"] and follow and attempt is None and number is not None and number < chunk["attempts"]:
            number, offset = number + 1, 0
            err.print(f"carma: task {task_id} was relaunched: attempt {number}'s output follows")
        elif chunk["done"] or (not chunk["text"] and not follow):
            if follow:  # how it ended, which the log alone may not say (a SIGKILL, an OOM crash)
                err.print(f"carma: task {task_id} {_ended(_call(client.task, task_id))}", highlight=False)
            return
        elif not chunk["text"]:
            time.sleep(0.5)
        next_chunk = partial(client.logs, task_id, stream, number, offset)
        chunk = _call(through_restarts, next_chunk, f"following task {task_id}'s log", err.print)


def _not_started(task: dict[str, Any], follow: bool) -> str:
    """Why a task has no log yet, for `carma logs`."""
    from carma.server.client import ENDED

    if task["state"] in ENDED:
        return f"never ran: {_ended(task)}"
    then = "its output follows once it starts" if follow else "no output yet"
    why = task["waiting_reason"] or task["activity"]
    return f"has not started: {then}. It is {task['state']}" + (f": {why}" if why else "")


def _ended(task: dict[str, Any]) -> str:
    """How it ended: its state, and the reason where that does not name the state itself ("cancelled by
    request", which read "cancelled: cancelled by request")."""
    reason, state = task["reason"], task["state"]
    return reason if reason.startswith(state) else state + (f": {reason}" if reason else "")


@app.command("cancel")
def cancel_cmd(task_ids: list[int]) -> None:
    """Cancel tasks: waiting ones leave the queue; running ones get SIGTERM, then SIGKILL."""
    refused = 0
    ids = list(dict.fromkeys(task_ids))  # an id given twice is one task, answered once
    for result in _call(_client().cancel_many, ids):  # together: no task starts on a GPU one of them freed
        if "error" in result:  # each on its own, as scancel does: one bad id does not keep the others running
            error_line(result["error"])
            refused += 1
            continue
        live = result["state"] in ("dispatched", "running")
        stopping = "already stopping (cancelled before)" if result.get("again") else "stopping (SIGTERM sent)"
        out.print(f"task {result['id']}: " + (stopping if live else "cancelled"))
    if refused:
        raise typer.Exit(2)


@app.command("wait")
def wait_cmd(
    task_ids: list[int],
    timeout: Annotated[float | None, typer.Option(help="Give up after this many seconds (exit 3).", min=0)] = None,
    as_json: JsonOption = False,
) -> None:
    """Wait until the tasks end; exit 0 if all completed, 1 otherwise (3 if it gave up waiting).

    It outlives a restart of the server: one that stops answering is polled again for a minute."""
    from carma.server.client import ClientError, WaitTimeout

    if timeout is not None and math.isnan(timeout):  # it passes min=0, and no time is past it
        raise fail(f"--timeout must be a number of seconds; got {timeout:g}")
    try:
        tasks = _client().wait(list(dict.fromkeys(task_ids)), timeout)  # a repeated id is one task, said once
    except WaitTimeout as e:
        if as_json:  # a script still gets every task's state, the ones that ended and the ones it gave up on
            _print_json([_ending(t) for t in e.tasks])
        else:  # how those that ended did: a failure among them went unsaid
            from carma.server.client import ENDED

            _say_ended([t for t in e.tasks if t["state"] in ENDED])
        raise fail(str(e), code=3) from None
    except ClientError as e:
        raise fail(e) from None
    if as_json:
        _print_json([_ending(t) for t in tasks])
    else:
        _say_ended(tasks)
    raise typer.Exit(0 if all(t["state"] == "completed" for t in tasks) else 1)


def _say_ended(tasks: list[dict[str, Any]]) -> None:
    for t in tasks:
        out.print(f"task {t['id']} {_ended(t)}", highlight=False)


def _ending(task: dict[str, Any]) -> dict[str, Any]:
    return {k: task[k] for k in ("id", "state", "waiting_reason", "reason")}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


@app.command("gpus")
def gpus_cmd(as_json: JsonOption = False) -> None:
    """Per-GPU memory, SMACT/SMOCC/DRAMA and their risk, validity, and tasks."""
    gpus = _call(_client().gpus)
    if as_json:
        _print_json(gpus)
        return
    rows = []
    for g in gpus:
        risk = g["risk"]
        state = "awaiting first kernel" if g["awaiting_first_kernel"] else ("ttfk window" if not g["valid"] else "ok")
        if g["excluded"]:
            state += ", risky"
        used = g["used_mib"] or 0
        memory = f"{used / 1024:.1f}/{g['total_mib'] / 1024:.1f} GiB"
        held = g.get("held_mib", 0)  # none from a daemon started before an upgrade
        if held > used:  # known needs not yet allocated: free to the eye, not to a placement
            memory += f" ({held / 1024:.1f} held)"
        growth = g.get("growth_mib", 0)
        if growth:  # predicted to be allocated yet: held against new tasks as well
            memory += f" (+{growth / 1024:.1f} growing)"
        rows.append(
            [
                str(g["index"]),
                g["name"],
                memory,
                _pct(g["smact"]),
                _pct(g["smocc"]),
                _pct(g["drama"]),
                "/".join(_pct(risk[k]) for k in ("smact", "smocc", "drama")) if risk else "-",
                state,
                ",".join(map(str, g["tasks"])) + (f" +{g['other_processes']} other" if g["other_processes"] else ""),
            ]
        )
    headers = ("GPU", "NAME", "MEMORY", "SMACT", "SMOCC", "DRAMA", "RISK (S/O/D)", "STATE", "TASK IDS")
    print(columns(headers, rows))
    status = _call(_client().status)
    for layout in (status.get("mig") or {}).get("gpus", []):  # none from a daemon before dynamic MIG
        out.print(_mig_layout(layout), highlight=False, soft_wrap=True)
    if not status["risk"]["enabled"]:  # a saturated GPU "ok" read as a filter that failed
        err.print("note: the risk filter is off ([scheduler.risk] enabled = false): no GPU is kept out for its risk")


def _mig_layout(layout: dict) -> str:  # type: ignore[type-arg]
    """`MIG GPU-...: 1g.10gb@0 (GPU 0, task 3), 3g.20gb@4 (GPU 1, idle); free memory slices 2, 3`."""
    instances = ", ".join(
        f"{i['slot']} (GPU {i['gpu']}, {'task ' + ','.join(map(str, i['tasks'])) if i['tasks'] else 'idle'})"
        for i in layout["instances"]
    )
    free = ", ".join(map(str, layout["free_slices"])) or "none"
    return f"MIG {layout['gpu']} ({layout['model']}): {instances or 'no instance'}; free memory slices {free}"


@app.command("status")
def status_cmd(as_json: JsonOption = False) -> None:
    """The server's version, policy, GPUs and task counts."""
    status = _call(_client().status)
    if as_json:
        _print_json(status)
        return
    counts = ", ".join(f"{n} {state}" for state, n in sorted(status["tasks"].items())) or "no tasks"
    drain = " (draining: no new placements)" if status["draining"] else ""
    mps = ", MPS" if status["mps"] else ""
    risk = "" if status["risk"]["enabled"] else ", risk filter off"  # else a risky GPU "ok" reads as a fault
    gpus = pluralize(status["gpus"], "GPU")
    if status.get("physical_gpus", status["gpus"]) != status["gpus"]:  # a server of an earlier release: not given
        gpus = f"{pluralize(status['gpus'], 'target')} (MIG instances) on {pluralize(status['physical_gpus'], 'GPU')}"
    tcp = f", on http://{status['tcp']}" if status.get("tcp") else ""  # none from a daemon before an upgrade
    out.print(
        f"carma {status['version']}: {gpus}{mps}, policy {status['policy']}{risk}{drain}{tcp}; {counts}",
        highlight=False,
    )
    if status["time_scale"] != 1:
        out.print(f"simulated time: {_scaled(status['time_scale'])}", highlight=False)
    for gpu, names in status["missing_metrics"].items():
        out.print(f"GPU {gpu}: no {', '.join(names)} (see `[scheduler.risk] missing`)", highlight=False)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


@app.command("history")
def history_cmd(
    hours: Annotated[float | None, typer.Option(help="Only attempts that ended in the last H hours.")] = None,
    limit: Annotated[int, typer.Option("--limit", "-n", help="The newest N runs.", min=1)] = HISTORY_RUNS,
    as_json: JsonOption = False,
) -> None:
    """Finished runs with what the GPUs saw of them: peak memory, time, mean SMACT/SMOCC/DRAMA.

    The peak is shown beside the memory each was placed with (declared or estimated)."""
    try:
        if hours is not None:
            positive(hours, "--hours")
    except UsageError as e:
        raise fail(e) from None
    runs = _call(_client().history, hours, limit)
    if as_json:
        _print_json(runs)
        return
    rows = [
        [
            f"{r['task_id']}.{r['attempt']}",
            clipped(r["name"]),
            r["user"],
            r["outcome"] or "",
            ",".join(map(str, r["gpus"])),
            f"{r['exec_s'] / 60:.1f}",
            "-" if r["peak_mib"] is None else f"{r['peak_mib'] / 1024:.2f} GiB",
            _need_text(r),
            (r["need_source"] or "").partition(":")[0],
            f"{_fmt(r['smact_mean'])}/{_fmt(r['smocc_mean'])}/{_fmt(r['drama_mean'])}",
        ]
        for r in runs
    ]
    headers = ("RUN", "NAME", "USER", "OUTCOME", "GPUS", "MINUTES", "PEAK", "PLACED WITH", "FROM", "SMACT/SMOCC/DRAMA")
    print(columns(headers, rows))
    if not runs:  # a header alone reads as a listing that failed
        err.print("no run ended" + (f" in the last {hours:g} h" if hours is not None else " yet"), highlight=False)
    elif len(runs) == limit:  # earlier ones may have been left out
        err.print(f"the newest {pluralize(limit, 'run')}; --limit for more", highlight=False)


@app.command("drain")
def drain_cmd() -> None:
    """Stop placing tasks (running ones continue); `carma resume` undoes it."""
    changed = _call(_client().drain, True)["changed"]
    out.print(f"{'draining' if changed else 'already draining'}: no new placements until `carma resume`")


@app.command("resume")
def resume_cmd() -> None:
    """Place tasks again after `carma drain`."""
    changed = _call(_client().drain, False)["changed"]
    out.print("placing tasks again" if changed else "not draining: placing tasks as before")
