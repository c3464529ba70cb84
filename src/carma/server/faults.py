"""Faults of the world the daemon lives through: a full disk, no file descriptors left, a store it cannot
write for a while.

They are not bugs: the daemon reports them, keeps answering, and tries again on the next scheduling step.
`WORLD_FAULTS` says which exceptions are such faults; anything else is a bug and stops the scheduling
loop as before, logged with its traceback.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from starlette.exceptions import HTTPException

WORLD_FAULTS = (OSError, sqlite3.OperationalError)  # sqlite3's own: full, locked, I/O error, cannot open
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
NO_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)
SQLITE_FULL = 13
REPEAT_S = 60.0  # a fault that lasts is reported again at most this often (wall seconds)


def no_space(exc: BaseException) -> bool:
    """Whether `exc` says the disk (or the user's quota) is full."""
    if isinstance(exc, sqlite3.Error):
        return getattr(exc, "sqlite_errorcode", None) == SQLITE_FULL or "database or disk is full" in str(exc)
    return isinstance(exc, OSError) and exc.errno in NO_SPACE


def known(exc: BaseException) -> bool:
    """A fault whose one line says all (no traceback needed to understand it)."""
    return no_space(exc) or (isinstance(exc, OSError) and exc.errno in NO_DESCRIPTORS)


def one_line(exc: BaseException) -> str:
    """`exc` as a log line reads it: "PATH: reason" for an OSError, not "[Errno 24] ... 'PATH'"."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror if exc.filename is None else f"{exc.filename}: {exc.strerror}"
    return str(exc) or type(exc).__name__


class StoreUnavailable(HTTPException):
    """A request that must write the daemon's state, refused because the state cannot be written now: 507
    when the disk is full, else 503. An HTTPException, so the API answers it as it is ({"detail": ...})."""

    def __init__(self, home: Path, exc: BaseException) -> None:
        if no_space(exc):
            super().__init__(507, f"no space left under {home}: {one_line(exc)}; nothing was changed")
        else:
            super().__init__(503, f"the daemon's state under {home} cannot be written: {one_line(exc)}")


@dataclass
class _Fault:
    text: str
    since: float
    reported: float
    repeats: int = 0  # failures since it was last reported


class FaultLog:
    """Reports each fault once when it starts, then at most every `repeat_s` with how often it recurred, and
    once when it clears: a disk full for hours must not write a line every second. Faults are kept apart
    by `where` (the part of the daemon that failed), so one clearing does not hide another."""

    def __init__(
        self, log: logging.Logger, repeat_s: float = REPEAT_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._log = log
        self._repeat_s = repeat_s
        self._clock = clock
        self._open: dict[str, _Fault] = {}

    @property
    def failing(self) -> list[str]:
        """Where a fault has not cleared yet."""
        return list(self._open)

    def failed(self, where: str, exc: BaseException) -> None:
        now, text = self._clock(), one_line(exc)
        fault = self._open.get(where)
        if fault is None or fault.text != text:
            self._open[where] = _Fault(text, now if fault is None else fault.since, now)
            # an unfamiliar fault gets its traceback once: it may be a bug that only looks like the world's
            self._log.error("%s failed: %s (retrying)", where, text, exc_info=None if known(exc) else exc)
            return
        fault.repeats += 1
        if now - fault.reported >= self._repeat_s:
            self._log.error("%s still fails: %s (%d times in %.0f s)", where, text, fault.repeats, now - fault.reported)
            fault.reported, fault.repeats = now, 0

    def cleared(self, where: str) -> None:
        fault = self._open.pop(where, None)
        if fault is not None:
            self._log.warning("%s works again, after %.0f s of: %s", where, self._clock() - fault.since, fault.text)

    @contextmanager
    def guard(self, where: str) -> Iterator[None]:
        """Run the block; a fault of the world in it is reported (and the block left), anything else raised."""
        try:
            yield
        except WORLD_FAULTS as e:
            self.failed(where, e)
        else:
            self.cleared(where)
