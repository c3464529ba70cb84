"""`carma server`: run the daemon."""

from __future__ import annotations

import ipaddress
import math
import os
import socket
from contextlib import closing
from pathlib import Path
from typing import Annotated
from urllib.parse import quote

import typer

from carma.cli.common import PATH_VALUE, UsageError, app, choice, err, error_line, fail, out, positive
from carma.sim.models import SHARING_MODES
from carma.units import pluralize


@app.command("server")
def server_cmd(
    fake_gpus: Annotated[
        str | None, typer.Option(help="Run on fake GPUs, e.g. 3xA100-40GB (the twin's GPU model in wall-clock time).")
    ] = None,
    time_scale: Annotated[float, typer.Option(help="With fake GPUs: simulated seconds per wall second.")] = 1.0,
    sharing: Annotated[
        str | None, typer.Option(help="With fake GPUs: how they share, mps or timeslice (default mps).")
    ] = None,
    fake_mig: Annotated[
        bool, typer.Option(help="With fake GPUs: make them with MIG mode enabled, as an admin would.")
    ] = False,
    mig: Annotated[
        str | None,
        typer.Option(
            help="static (place on the MIG instances found) or dynamic (create and destroy them per task); "
            "default: the config's \\[mig] mode, static."
        ),
    ] = None,
    policy: Annotated[
        str | None, typer.Option(help="exclusive, rr, magm, lug, ff, bf or pair (default: magm, or the config's).")
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            help="TOML configuration file (\\[scheduler], \\[estimate] and \\[server] sections).", **PATH_VALUE
        ),
    ] = None,
    tcp: Annotated[str | None, typer.Option(help="Also listen on HOST:PORT (bearer tokens required).")] = None,
    home: Annotated[
        Path | None,
        typer.Option(
            help="State directory (default: $CARMA_HOME, else /var/lib/carma as root, ~/.local/state/carma).",
            **PATH_VALUE,
        ),
    ] = None,
    grace: Annotated[float, typer.Option(help="Seconds between SIGTERM and SIGKILL when cancelling.", min=0)] = 10.0,
    mps: Annotated[bool, typer.Option(help="Run tasks as clients of carma's MPS control daemon (started).")] = False,
    check: Annotated[
        bool,
        typer.Option(
            "--check", help="Verify the state (the database, its backup) without starting: exit 0 sound, 1 not."
        ),
    ] = False,
) -> None:
    """Run the carma daemon: it queues, places and runs training tasks on this machine's GPUs."""
    import asyncio
    import logging
    import sqlite3
    from dataclasses import replace

    from carma.config import ConfigError, load_config
    from carma.core.mig.scheduling import MIG_MODES
    from carma.core.policies import POLICY_NAMES
    from carma.server.auth import Tokens
    from carma.server.daemon import Daemon
    from carma.server.executor import closed_to_others
    from carma.server.mps import MpsControl, MpsError
    from carma.server.paths import Paths, carma_home
    from carma.server.serve import (
        AlreadyRunning,
        check_socket_path,
        close_listeners,
        hold_state,
        listen,
        refuse_if_running,
        serve,
    )
    from carma.server.store import StoreError
    from carma.telemetry.nvml import NvmlUnavailable

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    paths = Paths(home.expanduser().resolve() if home else carma_home().absolute())  # as clients elsewhere reach it
    if check:
        raise typer.Exit(check_state(paths))
    if home:  # what the daemon reads from its CARMA_HOME (the devices' calibration) is read from there too
        os.environ["CARMA_HOME"] = str(paths.home)
    sockets = []
    try:
        settings = load_config(config)
        scheduler = settings.scheduler
        if policy:
            scheduler = replace(scheduler, policy=choice(policy, POLICY_NAMES, "--policy"))
        mig_config = settings.mig
        if mig:
            mig_config = replace(mig_config, mode=choice(mig, MIG_MODES, "--mig"))
        given_fake = ((time_scale != 1.0, "--time-scale"), (sharing is not None, "--sharing"), (fake_mig, "--fake-mig"))
        for given, option in given_fake:
            if given and not fake_gpus:
                raise ValueError(f"{option} only applies to fake GPUs (--fake-gpus)")
        positive(time_scale, "--time-scale")  # before the state directory keeps a clock of that scale
        if time_scale > MAX_TIME_SCALE:  # at 1e9 the daemon spun a core and TIME read 62798 hours
            raise UsageError(
                f"--time-scale must be at most {MAX_TIME_SCALE:,}; got {time_scale:g} (a task's start-up alone "
                "would be hours of simulated time)"
            )
        if not math.isfinite(grace):  # nan passes min=0, and a cancelled task that ignored SIGTERM ran on
            raise UsageError(f"--grace must be a finite number of seconds; got {grace:g}")
        check_socket_path(paths.socket)
        paths.create()
        lock = hold_state(paths)  # before anything in the state directory is read or changed
        refuse_if_running(paths.socket)  # a socket left by a daemon that died goes
        tokens = Tokens(paths.tokens)  # a malformed file stops the start before an MPS daemon or GPU is touched
        sockets, tcp = listen(paths.socket, tcp)  # so does a TCP port in use (found after MPS had started)
        sharing_mode = choice(sharing or "mps", SHARING_MODES, "--sharing")
        backend, env = _backend(paths, fake_gpus, sharing_mode, time_scale, scheduler.sample_interval_s, fake_mig)
        mig_control = _mig_control(backend) if mig_config.dynamic else None
        control = MpsControl(paths.home) if mps else None
        if control is not None:
            control.start()
        daemon = Daemon(
            paths,
            backend,
            scheduler,
            time_scale,
            env,
            grace,
            control,
            settings.estimate,
            settings.server.keep_ended_s,
            mig_config,
            mig_control,
            sharing_mode if fake_gpus else None,
        )
        if tcp and not tokens:
            tokens.create(_me(), os.geteuid(), admin=True)
            err.print(f"created an admin token for TCP clients in {paths.tokens}")
        daemon.tcp = tcp
    except (
        UsageError,
        ConfigError,
        ValueError,
        OSError,
        RuntimeError,
        AlreadyRunning,
        MpsError,
        NvmlUnavailable,
        StoreError,
        sqlite3.OperationalError,  # the database locked by another program, say
    ) as e:
        close_listeners(sockets, paths.socket)
        raise fail(e) from None
    if "twin" in settings.tables:
        err.print(
            f"warning: {config}: [twin] is for carma simulate; the server's fake GPUs are --fake-gpus and --sharing"
        )
    if tcp and not _loopback(tcp):
        err.print(
            f"warning: {tcp} is reachable from other machines, and tokens travel in clear HTTP: listen on "
            "127.0.0.1 and reach it through an SSH tunnel, or put a TLS reverse proxy in front"
        )
    missing = scheduler.risk.missing
    for gpu, names in backend.missing().items():
        effect = "kept out of collocation" if missing == "risky" else "judged without them"
        err.print(
            f"warning: GPU {daemon.scheduler.shown(gpu)} reports no {', '.join(names)}: {effect} "
            f"([scheduler.risk] missing = {missing})"
        )
    if daemon.executor.run_as_owner and (closed := closed_to_others()) is not None:
        err.print(
            f"warning: only root's tasks can start: {closed} is closed to other users, and each task runs as its "
            "owner with this Python (install carma where every user can read it, e.g. a virtual environment in /opt)"
        )
    gpus = ", ".join(f"{i}:{g.name}" for i, g in enumerate(daemon.gpus))
    out.print(
        f"carma server listening on {paths.socket}{' and http://' + tcp + ' (dashboard)' if tcp else ''}; "
        f"policy {daemon.scheduler.config.policy}; GPUs {gpus}"
        + (f" (fake, time x{time_scale:g})" if fake_gpus else "")
        + ("; tasks run under MPS" if mps else "")
        + (f"; MIG dynamic, scheme {mig_config.scheme.upper()}" if mig_config.dynamic else "")
        + ("; draining, as before the restart: no placements until `carma resume`" if daemon.draining else "")
        + (f"; clients reach it with CARMA_HOME={paths.home}" if home else "")
    )
    try:
        asyncio.run(serve(daemon, sockets, tokens, settings.server))
    finally:
        close_listeners(sockets, paths.socket)
        lock.close()


def check_state(paths) -> int:  # type: ignore[no-untyped-def]
    """`carma server --check`: whether the daemon would start on this state (0) or not (1, saying why and
    what to do), checked without changing anything (a running daemon's state may be checked); 2 for a
    state directory that is not there."""
    from datetime import datetime

    from carma.core.types import ACTIVE_STATES
    from carma.server.state import BACKUP_EVERY_S, earlier_state, fresh, open_store
    from carma.server.store import StoreError, backup_path, damaged

    if not paths.home.is_dir():
        raise fail(f"{paths.home}: no such state directory (--home or CARMA_HOME names it)")
    if not os.access(paths.home, os.W_OK):  # a read-only file system, say: the start writes there first
        error_line(f"{paths.home}: the server cannot write there (a read-only file system, or not its user's)")
        return 1
    try:
        paths.check_owner()
    except PermissionError as e:
        error_line(str(e))
        return 1
    database, backup = paths.database, backup_path(paths.database)
    try:
        if (state := fresh(database)) and not earlier_state(paths):
            out.print(f"ok: {database} is {state}: no tasks yet (a start makes it)", highlight=False, soft_wrap=True)
            return 0
        with closing(open_store(paths, readonly=True)) as store:
            problem = store.check()
            if problem != "ok":
                raise damaged(database, f"the database is damaged (integrity_check: {problem})")
            tasks = store.load()
            next_id = store.next_id
    except StoreError as e:
        error_line(str(e))
        return 1
    live = sum(t.task.state in ACTIVE_STATES for t in tasks)
    waiting = sum(not t.task.terminal for t in tasks) - live
    if backup.is_file():
        made = datetime.fromtimestamp(backup.stat().st_mtime).isoformat(" ", "seconds")
        kept = f"backup {backup} of {made}"
    else:
        kept = f"no backup yet ({backup}: made at each start and every {BACKUP_EVERY_S / 3600:g} hours)"
    out.print(
        f"ok: {database}: {pluralize(len(tasks), 'task')} ({waiting} waiting, {live} running), integrity ok, "
        f"next id {next_id}; {kept}",
        highlight=False,
        soft_wrap=True,
    )
    return 0


def _host(address: str) -> str:
    """HOST of a HOST:PORT listener, an IPv6 one without its brackets."""
    return address.rpartition(":")[0].strip("[]")


def _loopback(address: str) -> bool:
    """Whether a HOST:PORT listener is reachable from this machine only (a name is taken as not)."""
    host = _host(address)
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _reachable(address: str) -> str:
    """The listener's HOST:PORT as a browser elsewhere opens it: the machine's name for a wildcard host."""
    if _host(address) in ("0.0.0.0", "::"):
        return f"{machine_name()}:{address.rpartition(':')[2]}"
    return address


LOOPBACK_NAMES = ("localhost", "ip6-localhost", "ip6-loopback")
MAX_TIME_SCALE = 10_000  # simulated seconds per wall second: a day in under 9 s


def machine_name() -> str:
    """This machine's name for others: its fully qualified name, unless that is a loopback one (a hosts file
    that maps the host name to 127.0.0.1 beside `localhost` makes it `localhost`), then its host name."""
    fqdn = socket.getfqdn()
    return socket.gethostname() if fqdn.partition(".")[0] in LOOPBACK_NAMES else fqdn


def _me() -> str:
    from carma.server.auth import user_name

    return user_name(os.geteuid())


def _mig_control(backend):  # type: ignore[no-untyped-def]
    """How `--mig dynamic` makes and destroys MIG instances: through NVML, or in the fake device's layout."""
    from carma.telemetry.fake import FakeGpuBackend

    if isinstance(backend, FakeGpuBackend):
        from carma.telemetry.fakemig import FakeMigControl

        return FakeMigControl(backend.device)
    from carma.telemetry.mig import NvmlMigControl

    return NvmlMigControl()


def _backend(paths, fake_gpus: str | None, sharing: str, time_scale: float, interval_s: float, mig: bool = False):  # type: ignore[no-untyped-def]
    """The GPU backend (NVML for real GPUs, sampled every `interval_s`, or fake ones, with MIG mode enabled
    for `mig`) and the environment every task gets with it."""
    if fake_gpus is None:
        from carma.telemetry.nvml import NvmlBackend

        return NvmlBackend(interval_s=interval_s), {}
    from carma.sim.gpus import parse_gpus
    from carma.telemetry.fake import FakeGpuBackend, fake_env

    gpus = parse_gpus(fake_gpus)
    device = _fake_device(paths, gpus, sharing, time_scale, mig)
    return FakeGpuBackend(device.root), fake_env(device.root)


def _fake_device(paths, gpus, sharing: str, time_scale: float, mig: bool):  # type: ignore[no-untyped-def]
    """Reopen the fake device of an earlier run when it is the same (so placements stay valid), else make it.
    One that tasks still hold placements on is kept: the daemon would refuse new GPUs, and these would be
    gone for good."""
    from carma.server.daemon import placements_held
    from carma.server.state import open_store
    from carma.telemetry.fake import FakeDevice

    try:
        device = FakeDevice.open(paths.fake_gpus)
    except FileNotFoundError:
        return FakeDevice.create(paths.fake_gpus, gpus, sharing=sharing, time_scale=time_scale, mig=mig)
    kinds = [(device.kind(i).name, device.kind(i).total_mib) for i in range(device.count)]
    same = (device.sharing, device.time_scale, [device.mig_enabled(i) for i in range(device.count)])
    if kinds == [(g.name, g.total_mib) for g in gpus] and same == (sharing, time_scale, [mig] * len(gpus)):
        return device
    with closing(open_store(paths)) as store:
        held = placements_held(store)
    if held:
        names = [name for name, _ in kinds]
        group = ",".join(f"{names.count(name)}x{name}" for name in dict.fromkeys(names))
        raise RuntimeError(
            f"the fake GPUs of the last start still hold {pluralize(held, 'task')}: start it as then, "
            f"--fake-gpus {group} --time-scale {device.time_scale:g} --sharing {device.sharing}"
            f"{' --fake-mig' if device.mig_enabled(0) else ''} (or with a new CARMA_HOME)"
        )
    return FakeDevice.create(paths.fake_gpus, gpus, sharing=sharing, time_scale=time_scale, mig=mig)


mps_app = typer.Typer(help="carma's own MPS control daemon (pipe and logs under the state dir).", no_args_is_help=True)
app.add_typer(mps_app, name="mps")
HomeOption = Annotated[
    Path | None,
    typer.Option(
        help="State directory (default: $CARMA_HOME, else /var/lib/carma as root, ~/.local/state/carma).",
        **PATH_VALUE,
    ),
]


def _mps(home: Path | None):  # type: ignore[no-untyped-def]
    from carma.server.mps import MpsControl
    from carma.server.paths import Paths, carma_home

    return MpsControl(Paths(home or carma_home()).home)


def _mps_do(action: str, home: Path | None) -> None:
    from carma.server.mps import MpsError

    control = _mps(home)
    try:
        status = getattr(control, action)()
    except MpsError as e:
        raise fail(e) from None
    state = "running" if status.running else "stopped"
    servers = f", MPS servers {', '.join(map(str, status.servers))}" if status.servers else ""
    out.print(f"MPS control daemon {state} (pipe {control.pipe_dir}){servers}", highlight=False)


@mps_app.command("start")
def mps_start(home: HomeOption = None) -> None:
    """Start carma's MPS control daemon."""
    _mps_do("start", home)


@mps_app.command("stop")
def mps_stop(home: HomeOption = None) -> None:
    """Stop it (it quits once its clients are done)."""
    _mps_do("stop", home)


@mps_app.command("status")
def mps_status(home: HomeOption = None) -> None:
    """Whether it runs, and its servers."""
    _mps_do("status", home)


@app.command("dashboard")
def dashboard_cmd(home: HomeOption = None) -> None:
    """Print the dashboard's address, with your token when the server's tokens file is yours to read."""
    from carma.server.auth import Tokens
    from carma.server.client import Client, ClientError
    from carma.server.paths import Paths, server_socket

    paths = Paths(home or server_socket().parent)  # the server the client commands reach: its tokens
    remote = None if home else os.environ.get("CARMA_URL")  # --home names a server of this machine
    try:
        client = Client(paths.socket if home else None)  # CARMA_URL's form is checked here
        status = None if remote else client.status()  # a remote server is the address the user gave
    except ClientError as e:
        raise fail(e) from None
    if status is not None and not status.get("tcp"):
        raise fail("the server does not listen on TCP: start it with --tcp 127.0.0.1:8765 to use the dashboard")
    url = remote.rstrip("/") + "/" if remote else f"http://{_reachable(status['tcp'])}/"
    try:
        token = os.environ.get("CARMA_TOKEN") or (None if remote else Tokens(paths.tokens).of_uid(os.geteuid()))
    except (OSError, ValueError):  # not ours to read, or edited into a malformed one since the server started
        token = None
    if token:
        out.print(f"{url}#token={quote(token, safe='')}", highlight=False, soft_wrap=True)  # '&', '#', '%' too
    else:
        out.print(url, highlight=False)
        err.print("sign in on the page with your token (the server's admin can make you one)")
