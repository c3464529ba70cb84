"""Trace loaders: CARMA's CSV traces and trace scripts, and carma's own CSV/YAML format.

A trace is a list of (submit time, workload). Formats (see docs/traces.md):

- built-in names `carma-t1`, `carma-heavy60`, `carma-mix90` (packaged CSV traces);
- CARMA trace scripts: `sleep N` lines and `python .../submit.py --task .../NAME.rad` lines;
- CSV with columns `submit_s,task` and optional per-row workload fields
  (`gpus, solo_s, mem_mib, smact, smocc, drama, ttfk_s`);
- YAML with `tasks:` (each `at`, `task`, optional `repeat`/`every`) and optional `workloads:` definitions.
"""

from __future__ import annotations

import csv
import io
import itertools
import math
import shlex
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from carma.textfiles import NotText, load_yaml, read_text, yaml_problem
from carma.traces.catalog import (
    LONGEST_S,
    OVER_LONGEST,
    Catalog,
    UnknownTaskError,
    Workload,
    data_file,
    define_workload,
)
from carma.units import pluralize

BUILTIN_TRACES = {
    "carma-t1": "t1.csv",
    "carma-t2": "t2.csv",
    "carma-heavy60": "heavy60.csv",
    "carma-mix90": "mix90.csv",
}

_SLEEP_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}  # as coreutils' sleep reads them
_TASK_KEYS = {"at", "task", "repeat", "every"}
_SHELL_PUNCTUATION = ";&|()<>"  # the shell's operator characters: a script line's commands are split at them
MAX_ENTRIES = 100_000  # a server's trace (CARMA's have 60 to 90 tasks), bounded so a typo cannot fill memory
_YAML_KEYS = {"name", "workloads", "tasks"}


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file and line."""


@dataclass(frozen=True)
class TraceEntry:
    submit_s: float
    workload: Workload
    where: str = field(default="", compare=False)  # its file and line (or YAML task): errors found at submission


@dataclass(frozen=True)
class Trace:
    name: str
    entries: tuple[TraceEntry, ...]
    skipped: tuple[str, ...] = ()  # names of unknown tasks left out, one per entry

    def skipped_summary(self) -> str:
        counts = Counter(self.skipped)
        return ", ".join(f"{name} (x{n})" if n > 1 else name for name, n in sorted(counts.items()))

    def skipped_note(self) -> str:
        return f"skipped {pluralize(len(self.skipped), 'entry', 'entries')} of unknown tasks: {self.skipped_summary()}"


class _Builder:
    """Collects entries, resolving names against the catalog and reporting unknown ones."""

    def __init__(self, source: str, catalog: Catalog, skip_unknown: bool) -> None:
        self.source = source
        self.catalog = catalog
        self.skip_unknown = skip_unknown
        self.entries: list[TraceEntry] = []
        self.skipped: list[str] = []
        self.defined: dict[str, Workload] = {}  # new tasks rows defined, for the rows below that name them alone

    def add(self, where: str, submit_s: object, name: str, fields: Mapping[str, object] | None = None) -> None:
        if (t := _number(submit_s)) is None:
            raise TraceError(f"{self.source}, {where}: submit time {submit_s!r} is not a number")
        if not math.isfinite(t):
            raise TraceError(f"{self.source}, {where}: submit time must be a finite number of seconds, got {t}")
        if t < 0:
            raise TraceError(f"{self.source}, {where}: submit time must not be negative, got {t}")
        if t > LONGEST_S:
            raise TraceError(
                f"{self.source}, {where}: submit time {t:.12g} s {OVER_LONGEST}, not milliseconds or nanoseconds "
                "since the epoch"
            )
        try:
            workload = define_workload(name, fields or {}, self.catalog, self.defined.get(name))
            if fields and name not in self.catalog:  # its first row defines it; those below override for themselves
                self.defined.setdefault(name, workload)
        except UnknownTaskError as err:
            if self.skip_unknown and not fields:  # a row that defines the task too thinly is a mistake, not a skip
                self.skipped.append(name)
                return
            hint = "" if fields else " (use --skip-unknown to leave it out)"
            raise TraceError(f"{self.source}, {where}: {err}{hint}") from None
        except ValueError as err:
            raise TraceError(f"{self.source}, {where}: {err}") from None
        if len(self.entries) == MAX_ENTRIES:  # a `repeat: 100000000` filled gigabytes before anything ran
            raise TraceError(f"{self.source}, {where}: a trace holds at most {MAX_ENTRIES} tasks")
        self.entries.append(TraceEntry(t, workload, f"{self.source}, {where}"))

    def build(self, name: str) -> Trace:
        entries = sorted(self.entries, key=lambda e: e.submit_s)  # stable: ties keep file order
        trace = Trace(name, tuple(entries), tuple(self.skipped))
        if not entries:
            n = len(self.skipped)
            left_out = (
                f" once its {pluralize(n, 'entry', 'entries')} of unknown tasks {'is' if n == 1 else 'are'} left out: "
                f"{trace.skipped_summary()}"
                if self.skipped
                else ""
            )
            raise TraceError(f"{self.source}: the trace has no tasks{left_out}")
        return trace


def _read_csv(text: str, b: _Builder) -> None:
    # universal newlines: a file of bare CRs (a spreadsheet's "CSV (Macintosh)") is lines, as CRLF ones are
    reader = csv.DictReader(io.StringIO(text, newline=None))
    if reader.fieldnames:  # `submit_s, task` as people write it: the names without their spaces
        reader.fieldnames = [name.strip() for name in reader.fieldnames]
        if twice := sorted({name for name in reader.fieldnames if reader.fieldnames.count(name) > 1}):
            raise TraceError(f"{b.source}: the header names column(s) {', '.join(map(repr, twice))} twice")
    if not reader.fieldnames or not {"submit_s", "task"} <= set(reader.fieldnames):
        other = next((sep for sep in ";\t|" if sep in "".join(reader.fieldnames or ())), None)
        hint = (
            f" (its header is separated by {other!r}: a CSV trace's columns are separated by commas)" if other else ""
        )
        raise TraceError(f"{b.source}: a CSV trace needs the columns submit_s and task{hint}")
    for row in _rows(reader, b.source):
        lineno = reader.line_num  # the file's line, blank lines and quoted line breaks counted
        values = [v for v in row.values() if isinstance(v, str)]  # not a short row's None, an extra's list
        if any("\n" in v for v in values):  # no field of a trace has one
            start = lineno - sum(v.rstrip("\n").count("\n") for v in values)
            span = f"lines {start}-{lineno}" if lineno > start else f"line {lineno}"  # one open at the end: the last
            raise TraceError(f"{b.source}, {span}: a quoted value holds a line break (a quote left open?)")
        if None in row:
            raise TraceError(f"{b.source}, line {lineno}: more values than the header has columns")
        if not (name := (row["task"] or "").strip()):  # not an unknown task for --skip-unknown to leave out
            raise TraceError(f"{b.source}, line {lineno}: no task name")
        fields = {k: v for k, v in row.items() if k not in ("submit_s", "task") and v not in (None, "")}
        b.add(f"line {lineno}", row["submit_s"], name, fields)


def _rows(reader: csv.DictReader, source: str) -> Iterator[dict[str, Any]]:
    """The reader's rows, its errors as TraceErrors at the line its row began on (a quote left open reads
    the rest of the file as one value, up to the module's 128 KiB limit)."""
    while True:
        start = reader.line_num + 1
        try:
            yield next(reader)
        except StopIteration:
            return
        except csv.Error as err:
            open_quote = " (a quote left open?)" if "field limit" in str(err) else ""
            raise TraceError(f"{source}, line {start}: {err}{open_quote}") from None


def _read_script(text: str, b: _Builder) -> None:
    """Each line's commands, as the shell would run them (quotes, `#` comments, `;`, `&&` and `&`): `sleep N`
    advances the clock, a `submit... --task PATH/NAME.rad` command submits NAME. Commands sent to the
    background (`sleep 60 && submit ... &`) keep a clock of their own: the next ones do not wait for them."""
    t = 0.0
    for lineno, line in _logical_lines(text):
        where = f"{b.source}, line {lineno}"
        for commands, background in _lists(line, where):
            clock = t
            for words in commands:
                if words[0] == "sleep" and len(words) >= 2:  # coreutils sleeps for the sum of its arguments
                    clock += sum(_sleep_s(word, where) for word in words[1:])
                elif any("submit" in w for w in words) and (task := _task_argument(words)):
                    b.add(f"line {lineno}", clock, Path(task).name.removesuffix(".rad"))
                elif lineno == 1 and "submit_s" in words and "task" in words:  # a CSV by another name
                    raise TraceError(
                        f"{where}: this looks like a CSV trace; carma reads one from a file named .csv, its columns "
                        "separated by commas (other names are CARMA trace scripts)"
                    )
                else:
                    raise TraceError(
                        f"{where}: expected 'sleep N' or a submit.py --task command, not {shlex.join(words)!r}"
                        + _format_hint(line)
                    )
            if not background:
                t = clock


def _logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """The script's lines as the shell reads them, each with the number of its first: one ending in a
    backslash (its newline escaped) or in `&&` goes on on the next."""
    start, joined = 0, ""
    for lineno, line in enumerate(text.splitlines(), start=1):
        start, code = start or lineno, _uncommented(line)  # a comment's backslash or `&&` continues nothing
        if (len(code) - len(code.rstrip("\\"))) % 2 == 1:
            joined += code[:-1]
        elif code.rstrip().endswith("&&"):
            joined += code + " "
        else:
            yield start, joined + line
            start, joined = 0, ""
    if joined:
        yield start, joined


def _task_argument(words: list[str]) -> str | None:
    """The one `--task PATH` (or `--task=PATH`, as argparse takes it too) of a submit command, if it has one."""
    given = [w.removeprefix("--task=") for w in words if w.startswith("--task=")]
    given += [after for w, after in itertools.pairwise(words) if w == "--task"]
    return given[0] if len(given) == 1 and words[-1] != "--task" else None


def _format_hint(line: str) -> str:
    """For a script line that looks like another format's: the format is chosen by the file's suffix."""
    if "submit_s" in line and "," in line:
        return " (a CSV trace is read as one when its name ends in .csv)"
    if line.split(":")[0].strip() in _YAML_KEYS:
        return " (a YAML trace is read as one when its name ends in .yaml or .yml)"
    return ""


def _lists(line: str, where: str) -> list[tuple[list[list[str]], bool]]:
    """A script line's command lists as the shell runs them: each one's commands (joined by `&&`), and
    whether it goes to the background (ended by `&`, not `;` or the line's end); other syntax is an error."""
    lexer = shlex.shlex(_uncommented(line), posix=True, punctuation_chars=_SHELL_PUNCTUATION)
    lexer.whitespace_split = True
    lexer.commenters = ""  # `_uncommented` cut the comment: shlex would cut `--task a#1.rad` at its `#` too
    try:
        tokens = list(lexer)
    except ValueError as e:  # an unclosed quote
        raise TraceError(f"{where}: {e}") from None
    lists: list[tuple[list[list[str]], bool]] = []
    commands: list[list[str]] = [[]]
    for token in tokens:
        if token in (";", "&", "&&") and not commands[-1]:  # `a && && b`, `a ; ; b`, a leading `;`: the shell refuses
            raise TraceError(f"{where}: a command is missing before {token!r}")
        if token in (";", "&"):
            lists.append((commands, token == "&"))
            commands = [[]]
        elif token == "&&":
            commands.append([])
        elif token and set(token) <= set(_SHELL_PUNCTUATION):
            raise TraceError(f"{where}: {token!r}: a trace script takes commands joined by ';', '&&' or '&' only")
        else:
            commands[-1].append(token)
    if not commands[-1] and len(commands) > 1:  # the script's last line: others go on on the next
        raise TraceError(f"{where}: a command is missing after '&&'")
    if commands[-1]:
        lists.append((commands, False))
    return lists


def _uncommented(line: str) -> str:
    """The line without its comment: from a `#` that begins a word, outside quotes, as the shell reads it
    (`a#b`, `a\\ #b` are one word, `'#'` a quoted one)."""
    quote = None
    escaped = False
    word_start = True
    for i, char in enumerate(line):
        if escaped:  # a backslash's character is part of a word, even a space
            escaped = word_start = False
        elif quote is not None:
            quote = None if char == quote else quote
            escaped = char == "\\" and quote == '"'
        elif char == "#" and word_start:
            return line[:i]
        else:
            quote = char if char in "'\"" else None
            escaped = char == "\\"
            word_start = char.isspace() or char in _SHELL_PUNCTUATION
    return line


def _sleep_s(word: str, where: str) -> float:
    """A `sleep` line's seconds: a number with coreutils' optional unit (s, m, h, d)."""
    number, unit = word[:-1], word[-1]
    if unit not in _SLEEP_UNITS:
        number, unit = word, ""
    try:
        seconds = float(number) * _SLEEP_UNITS[unit]
    except ValueError:
        raise TraceError(f"{where}: cannot read 'sleep {word}'") from None
    if not 0 <= seconds < math.inf:
        raise TraceError(f"{where}: 'sleep {word}': the time must not be negative or infinite")
    return seconds


def _read_yaml(text: str, b: _Builder) -> str | None:
    import yaml  # here, not at the top: every `carma` command imports this module, few read YAML

    try:
        doc = load_yaml(text)
    except yaml.YAMLError as err:
        raise TraceError(f"{b.source}: not valid YAML ({yaml_problem(err)})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("tasks"), list):
        raise TraceError(f"{b.source}: a YAML trace needs a 'tasks' list")
    unknown_keys = set(doc) - _YAML_KEYS
    if unknown_keys:
        raise TraceError(
            f"{b.source}: unknown key(s) {', '.join(sorted(map(str, unknown_keys)))} (a YAML trace has "
            "name, workloads and tasks)"
        )
    if not isinstance(doc.get("name", ""), str):
        raise TraceError(f"{b.source}: 'name' must be a string, not {doc['name']!r}")
    definitions = {} if doc.get("workloads") is None else doc["workloads"]
    if not isinstance(definitions, dict):
        raise TraceError(f"{b.source}: 'workloads' must map task names to their fields")
    defined: dict[str, Workload] = {}  # each against the catalog alone, as CSV rows: new tasks default to its median
    for name, fields in definitions.items():
        if not isinstance(fields, dict | None):
            raise TraceError(f"{b.source}, workloads: task {name!r} needs a mapping of fields, not {fields!r}")
        if not fields and str(name) not in b.catalog:  # else "unknown task", for the task it defines
            raise TraceError(f"{b.source}, workloads: task {name!r} gives no fields: define it with solo_s and mem_mib")
        try:
            defined[str(name)] = define_workload(str(name), fields or {}, b.catalog)
        except (ValueError, UnknownTaskError) as err:  # a definition too thin is an error, even with skipping
            raise TraceError(f"{b.source}, workloads: {err}") from None
    b.catalog = b.catalog.with_workloads(defined)
    for i, item in enumerate(doc["tasks"], start=1):
        where = f"task {i}"
        if not isinstance(item, dict) or "task" not in item or "at" not in item:
            raise TraceError(f"{b.source}, {where}: each task needs 'at' (seconds) and 'task' (a name)")
        unknown = set(item) - _TASK_KEYS
        if unknown:
            raise TraceError(f"{b.source}, {where}: unknown key(s) {', '.join(sorted(map(str, unknown)))}")
        repeat = item.get("repeat", 1)
        if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
            raise TraceError(f"{b.source}, {where}: 'repeat' must be a positive integer")
        if "every" in item and "repeat" not in item:  # one task: the interval would say nothing
            raise TraceError(f"{b.source}, {where}: 'every' spaces a task's repeats: give 'repeat' too")
        # read as 'at' is: YAML 1.1 takes `1e3` (no dot) for text, which 'every' refused as "not finite"
        every, start = (_seconds(item, key, b.source, where) for key in ("every", "at"))
        if not 0 <= every < math.inf:
            raise TraceError(f"{b.source}, {where}: 'every' must be a finite number of seconds >= 0")
        if isinstance(item["task"], bool) or not isinstance(item["task"], str | int):  # `task: null`, a list
            raise TraceError(f"{b.source}, {where}: 'task' must be a task name, not {item['task']!r}")
        for k in range(repeat):
            b.add(where, start + k * every, str(item["task"]))
    return doc.get("name")


def _number(value: object) -> float | None:
    """A time as a float: a number or its text (a CSV's, or YAML 1.1's `1e3`); None for anything else, `yes`
    (a bool to YAML) included."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _seconds(item: dict[str, Any], key: str, source: str, where: str) -> float:
    """A YAML task's `at` or `every` (0 when not given)."""
    if (value := _number(item.get(key, 0))) is None:
        raise TraceError(f"{source}, {where}: '{key}' must be a number of seconds")
    return value


def load_trace(ref: str, catalog: Catalog, skip_unknown: bool = False) -> Trace:
    """Load a built-in trace by name or a trace file in any supported format."""
    if ref in BUILTIN_TRACES:
        path, name = data_file(BUILTIN_TRACES[ref]), ref
        source = f"{ref} ({path.name})"
    else:
        path, name = Path(ref), Path(ref).stem
        source = path.name
        if ref and path.is_dir():  # Path("") is "."
            raise TraceError(f"trace {ref!r} is a directory: give a trace file in it")
        if not ref or not path.exists():
            known = ", ".join(BUILTIN_TRACES)
            raise TraceError(f"no trace file {ref!r} (built-in traces: {known})")
        if not path.is_file():  # a pipe (`<(...)`) has no name whose suffix says the trace's format
            raise TraceError(f"trace {ref!r} is not a regular file: save the trace to a file (.csv, .yaml or a script)")
    try:
        text = read_text(path, path.name)
    except NotText as err:
        raise TraceError(str(err)) from None
    b = _Builder(source, catalog, skip_unknown)
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml", ".json"):  # JSON is YAML too
        name = _read_yaml(text, b) or name
    elif suffix == ".csv":
        _read_csv(text, b)
    else:
        _read_script(text, b)
    return b.build(name)
