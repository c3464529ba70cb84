"""What the API shows of the daemon's state: the JSON views of tasks, GPUs and the server's status."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from carma import __version__
from carma.core.blocked import Estimating
from carma.core.config import OWN_DECISIONS
from carma.core.memory import given_need
from carma.core.scheduler import GpuStatus
from carma.core.types import ACTIVE_STATES, MemoryNeed, TargetId, Task, TaskState
from carma.reasons import render, target_label
from carma.server.client import DRAINING
from carma.server.daemon import Daemon

NOT_SEEN_YET = "started; not yet seen on its GPU"  # a dispatched task: running once its first kernel shows


# carma's own scheduling switches ([scheduler], docs/policy.md): what a twin run of the same tasks needs to mirror
OWN_SWITCHES = ("hold_known_needs", *OWN_DECISIONS, "predict_growth")


def shown_targets(daemon: Daemon) -> dict[TargetId, int | str]:
    """The server's targets as users name them (`carma gpus`), copied for a thread: a target not among them
    has left, and is named by its id."""
    scheduler = daemon.scheduler
    return {g: scheduler.shown(g) for g in scheduler.gpus}


def status_view(daemon: Daemon) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for task in daemon.scheduler.tasks:
        counts[task.state.value] = counts.get(task.state.value, 0) + 1
    risk, shown = daemon.scheduler.config.risk, daemon.scheduler.shown
    return {
        "version": __version__,
        "clock_s": daemon.clock.now(),
        "uptime_s": round(daemon.clock.now() - daemon.clock.to_clock(daemon.started), 1),
        "time_scale": daemon.clock.scale,
        "policy": daemon.scheduler.config.policy,
        "risk": asdict(risk),  # the server's [scheduler.risk], all of it: weights and `missing` were left out
        "decisions": {name: getattr(daemon.scheduler.config, name) for name in OWN_SWITCHES},
        "draining": daemon.draining,
        "gpus": len(daemon.scheduler.gpus),  # the targets now: a MIG reconfiguration changes them
        "physical_gpus": len({t.gpu for t in daemon.scheduler.gpus.values()}),  # MIG instances' GPUs counted once
        "mps": daemon.mps is not None,
        "tcp": daemon.tcp,
        "mig": mig_view(daemon),
        "missing_metrics": {str(shown(gpu)): list(names) for gpu, names in daemon.backend.missing().items()},
        "tasks": counts,
    }


def mig_view(daemon: Daemon) -> dict[str, Any] | None:
    """Dynamic MIG (None without it): the reconfigurations so far, and each MIG GPU's layout: its instances (by
    start: profile, memory slices, position, tasks) and the memory slices no instance holds."""
    mig = daemon.mig
    if mig is None:
        return None
    layouts, statuses = [], daemon.scheduler.gpu_status(daemon.clock.now())
    for gpu, geometry in mig.geometries.items():
        instances, taken = [], set()
        for status in statuses:
            slot = status.gpu.slot
            if status.gpu.parent != gpu or slot is None:
                continue
            size = geometry.profile(slot.profile).memory_slices
            taken.update(range(slot.start, slot.start + size))
            position = daemon.scheduler.shown(status.gpu.id)
            instances.append(
                {"slot": str(slot), "start": slot.start, "slices": size, "gpu": position, "tasks": list(status.tasks)}
            )
        free = [i for i in range(geometry.memory_slices) if i not in taken]
        layouts.append(
            {
                "gpu": gpu,
                "model": geometry.model,
                "memory_slices": geometry.memory_slices,
                "instances": sorted(instances, key=lambda i: i["start"]),
                "free_slices": free,
            }
        )
    return {"reconfigurations": mig.reconfigurations, "refused": mig.refused, "gpus": layouts}


def task_summary(daemon: Daemon, task: Task) -> dict[str, Any]:
    job = daemon.jobs[task.id]
    a = task.current
    return {
        "id": task.id,
        "name": job.name,
        "user": job.user,
        "state": task.state.value,
        "gpus_requested": job.gpus,
        "mem_mib": job.mem_mib,
        "estimate": job.estimator,
        **_need_view(daemon, task),
        "gpus": [daemon.scheduler.shown(g) for g in a.gpus] if a and a.ended_s is None else [],
        "submit_s": task.submit_s,
        "start_s": a.dispatched_s if a else None,  # the latest attempt's: a relaunch's run starts anew
        "ended_s": task.ended_s,
        "attempts": len(task.attempts),
        "waiting_reason": _waiting_reason(daemon, task),
        "activity": _activity(daemon, task),
        "reason": task.reason,
    }


def _activity(daemon: Daemon, task: Task) -> str | None:
    """What a started task is doing that its state does not say: stopping after a cancel (in the grace period
    it looked like any running task), or not yet seen on its GPU."""
    if task.state not in ACTIVE_STATES:
        return None
    if task.cancel_requested:
        return f"cancelled; stopping (SIGTERM sent, SIGKILL if it runs on after {daemon.executor.grace_s:g} s)"
    return NOT_SEEN_YET if task.state is TaskState.DISPATCHED else None


def _waiting_reason(daemon: Daemon, task: Task) -> str | None:
    """The scheduler's reason, with how far the estimate is when the task waits for one; while the server
    drains, that it drains (also for a task just submitted, which the scheduler has not yet looked at)."""
    if daemon.draining and not task.terminal and task.state not in ACTIVE_STATES:
        return DRAINING
    blocked = daemon.scheduler.blocked(task.id)
    if blocked is None:
        return None
    progress = daemon.estimates.progress(task.id) if isinstance(blocked, Estimating) else None
    words = render(blocked, target_label(daemon.scheduler))
    return f"{words} ({daemon.jobs[task.id].estimator}: {progress})" if progress else words


def _need_view(daemon: Daemon, task: Task) -> dict[str, Any]:
    """The memory the scheduler plans the task with: its relaunch's when it waits for recovery (whole GPUs; the
    next larger MIG instance; a predicted peak), else its last placement's need, else the declared value, else a
    finished estimate; all None while its estimate is still to come."""
    if task.state is TaskState.RECOVERING:
        need: MemoryNeed | None = daemon.scheduler.relaunch_need(task)
    else:
        need = task.current.need if task.current else None
    if need is None:
        job = daemon.jobs[task.id]
        need = given_need(job.mem_mib, estimated=job.estimator is not None) or daemon.estimates.settled(task.id)
    if need is None:
        return {"need_mib": None, "need": None, "need_source": None}
    return {"need_mib": need.mib, "need": need.kind.value, "need_source": need.source}


OWNERS_ONLY = "its owner's to see"  # in place of what a task's own output says, shown to other users


def as_seen_by_others(view: dict[str, Any]) -> dict[str, Any]:
    """A task's view for a user other than its owner (and not an admin): the queue is everyone's, but a task's
    environment (tokens, keys) and what its output says (the reason it failed, an OOM line, why its estimate
    failed: the last lines of its logs) are its owner's, as its logs are."""
    seen = {**view, "need_source": source_only(view["need_source"])}
    if view["reason"]:
        seen["reason"] = OWNERS_ONLY
    if "env" in view:
        seen["env"] = None
    if "attempt_list" in view:
        seen["attempt_list"] = [
            {**a, "message": a["message"] and OWNERS_ONLY, "need_source": source_only(a["need_source"])}
            for a in view["attempt_list"]
        ]
    return seen


def source_only(source: str | None) -> str | None:
    """A need's source without what follows its colon (`xmem failed: <the capture's last error line>`)."""
    return source.split(":", 1)[0] if source else source


def task_view(daemon: Daemon, task: Task) -> dict[str, Any]:
    job = daemon.jobs[task.id]
    estimate = daemon.estimates.made(task.id)
    return {
        **task_summary(daemon, task),
        "command": list(job.argv),
        "shell": job.shell,
        "workdir": job.workdir,
        "env": dict(job.env) if not task.terminal else daemon.store.environment(task.id),  # `Daemon.jobs` has none
        "duration_s": job.duration_s,  # the run time declared at submission (None: its command's history)
        "memory_estimate": estimate.to_json() if estimate else None,  # `carma estimate --json`'s object
        "attempt_list": [
            {
                "number": a.number,
                "gpus": [daemon.scheduler.shown(g) for g in a.gpus],
                "targets": list(a.gpus),  # their ids: a GPU's UUID, or a MIG instance's
                "instance": _instance(daemon, a.gpus),  # a MIG instance's profile@start, while it exists
                "dispatched_s": a.dispatched_s,
                "first_kernel_s": a.first_kernel_s,
                "ended_s": a.ended_s,
                "outcome": a.outcome.value if a.outcome else None,
                "restarted_early": a.restarted_early,  # relaunched as after an OOM crash, before one
                "message": a.message,
                "recovery": a.recovery,
                "exclusive": a.exclusive,  # started alone on its GPUs
                "shared": a.shared,  # another task or process was on them at some point
                "need_mib": a.need.mib if a.need else None,
                "need": a.need.kind.value if a.need else None,
                "need_source": a.need.source if a.need else None,
            }
            for a in task.attempts
        ],
    }


def _instance(daemon: Daemon, targets: tuple[TargetId, ...]) -> str | None:
    target = daemon.scheduler.gpus.get(targets[0]) if len(targets) == 1 else None
    return f"{target.slot} of {target.parent}" if target is not None and target.slot is not None else None


def gpu_views(daemon: Daemon) -> list[dict[str, Any]]:
    """Every target as `carma gpus` lists it, in the server's order (its position is its index)."""
    return [gpu_view(i, status) for i, status in enumerate(daemon.scheduler.gpu_status(daemon.clock.now()))]


def gpu_view(index: int, status: GpuStatus) -> dict[str, Any]:
    s, r, target = status.latest, status.risk, status.gpu
    return {
        "index": index,
        "name": target.name,
        "uuid": target.id,  # its identity: what attempts and samples are kept by
        "kind": target.kind.value,
        "parent": target.gpu,  # the physical GPU (itself for a whole GPU)
        "compute": target.compute or None,  # SMs, or a MIG instance's; None: not known
        "total_mib": target.total_mib,
        "exclusive": not target.shareable,  # a MIG instance: one task at a time
        "slot": str(target.slot) if target.slot else None,  # a MIG instance's profile and first memory slice
        "used_mib": s.used_mib if s else None,
        "held_mib": status.held_mib,  # its tasks' known needs: no other task is placed into them
        "growth_mib": status.growth_mib,  # what its tasks are predicted to allocate yet: held as well
        "smact": s.smact if s else None,
        "smocc": s.smocc if s else None,
        "drama": s.drama if s else None,
        "power_w": s.power_w if s else None,
        "energy_j": s.energy_j if s else None,
        "temperature_c": s.temperature_c if s else None,
        "risk": {"smact": r.smact, "smocc": r.smocc, "drama": r.drama} if r else None,
        "excluded": status.excluded,
        "valid": status.valid,
        "awaiting_first_kernel": status.awaiting_first_kernel,
        "tasks": list(status.tasks),
        "other_processes": status.foreign,
    }
