"""A job function's capture: `module:function` (or `path/file.py:function`) returns the model, a batch, the
loss and the optimizer (a `TrainingJob`), for programs that cannot run as a script."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from carma.estimate import cuda_on_cpu
from carma.estimate.base import Capture, EstimateError, Exited, TrainingJob
from carma.estimate.session import (
    DEFAULT_STEPS,
    REASON_CHARS,
    HostMemoryShort,
    StepLimitReached,
    capturing,
    check_host_memory,
    hide_cuda,
    last_line,
)
from carma.units import cut


def capture_job(target: str, steps: int = DEFAULT_STEPS, *, exact: bool = False) -> Capture:
    """Build the job from `target` ("module:function" or "path/file.py:function") and profile `steps`
    iterations of `zero_grad(); loss(model, batch).backward(); step()` in this process (`step(closure)` doing
    the rest, for an optimizer whose step needs a closure: L-BFGS).

    CUDA is hidden from this process first (unless PyTorch already initialised it); what the job puts on
    CUDA stays on the CPU (`carma.estimate.cuda_on_cpu`). Building it is not profiled: its parameters are
    read from the model.
    """
    started = time.perf_counter()
    hide_cuda()
    function = _load_job_function(target)
    with cuda_on_cpu.cuda_on_cpu() as cuda:
        try:
            job = _as_job(function(), target)
        except EstimateError:
            raise
        except SystemExit as exc:
            raise _exited(exc, f"the job function {target}") from None
        except Exception as exc:
            raise EstimateError(cuda_on_cpu.explained(f"the job function {target} failed: {last_line(exc)}")) from None
        with_closure = _needs_closure(job.optimizer)  # L-BFGS: the step evaluates the loss itself, maybe often
        try:
            check_host_memory(job.model)
        except HostMemoryShort as e:
            raise EstimateError(str(e)) from None
        with capturing(steps, exact) as session:
            session.start()
            try:
                for _ in range(steps):
                    if with_closure:
                        job.optimizer.step(lambda: _iteration(job))
                    else:
                        _iteration(job)
                        job.optimizer.step()
            except StepLimitReached:
                pass
            except SystemExit as exc:
                raise _exited(exc, f"the training step of {target}") from None
            except Exception as exc:
                failed = f"the training step of {target} failed: {last_line(exc)}"
                raise EstimateError(cuda_on_cpu.explained(failed)) from None
        cuda.hold()  # what the function put on CUDA and its module still holds
    notes = (*session.notes, *cuda_on_cpu.notes(cuda.asked))
    seconds = time.perf_counter() - started
    return Capture(
        job,
        session.trace,
        steps,
        seconds,
        notes=notes,
        mixed_precision=tuple(session.mixed_precision),
        cuda_data=tuple(cuda.held.values()),
    )


def _exited(exc: SystemExit, what: str) -> EstimateError:
    """A job's `sys.exit` (argparse's, at its import) as an error: its message, or its status with the last
    line of its error output; uncaught, it ended the capture's process as if it had died."""
    if isinstance(exc.code, str):
        return EstimateError(f"{what} exited: {cut(exc.code, REASON_CHARS)}")
    return Exited(f"{what} exited with status {exc.code or 0}")


def _iteration(job: TrainingJob) -> Any:
    job.optimizer.zero_grad()
    loss = job.loss(job.model, job.batch)
    loss.backward()
    return loss


def _needs_closure(optimizer: Any) -> bool:
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    return closure is not None and closure.default is inspect.Parameter.empty


def job_parts(target: str) -> tuple[str, str]:
    """(module or file, function) of a job target."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise EstimateError(f"job {target!r} is not 'module:function' or 'path/to/file.py:function'")
    return where, name


def _load_job_function(target: str) -> Callable[[], Any]:
    where, name = job_parts(target)
    try:
        if where.endswith(".py"):
            path = Path(where).resolve()
            if not path.is_file():
                raise EstimateError(f"job file {where} does not exist")
            sys.path.insert(0, str(path.parent))
            spec = importlib.util.spec_from_file_location(f"_carma_job_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # as an import would (dataclasses and pickling look it up)
            spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(where)
    except EstimateError:
        raise
    except SystemExit as exc:
        raise _exited(exc, f"importing {where}") from None
    except Exception as exc:
        raise EstimateError(f"cannot import {where}: {last_line(exc)}") from None
    if not hasattr(module, name):
        raise EstimateError(f"{where} has no function {name}")
    function = getattr(module, name)
    if not callable(function):
        raise EstimateError(f"{where}:{name} is not a function (type {type(function).__name__})")
    return function


def _as_job(result: Any, target: str) -> TrainingJob:
    import torch

    if isinstance(result, tuple | list) and len(result) == 4:
        result = TrainingJob(*result)
    if not isinstance(result, TrainingJob):
        raise EstimateError(
            f"{target} returned {type(result).__name__}; expected a TrainingJob or (model, batch, loss, optimizer)"
        )
    if not isinstance(result.model, torch.nn.Module):
        raise EstimateError(f"{target}: the model is a {type(result.model).__name__}, not a torch.nn.Module")
    if not isinstance(result.optimizer, torch.optim.Optimizer):
        raise EstimateError(f"{target}: the optimizer is a {type(result.optimizer).__name__}, not a torch.optim one")
    if not callable(result.loss):
        raise EstimateError(f"{target}: the loss is not callable as loss(model, batch)")
    devices = {p.device.type for p in result.model.parameters()}
    if devices - {"cpu"}:
        raise EstimateError(f"{target} put the model on {', '.join(sorted(devices))}; build the job on the CPU")
    return result
