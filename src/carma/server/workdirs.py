"""A submission's working directory, checked off the event loop, with a timeout.

The check is a `stat` with the daemon's rights: on a hung NFS home or a FUSE mount it may never return,
and nothing on the event loop may wait for ever. The API runs it on a thread of its own (daemon threads:
a stuck one never holds up a stop) and refuses the submission when it takes over `TIMEOUT_S`; while
`SLOTS` checks are stuck, further submissions are refused at once, saying why, and the loop goes on.
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import suppress
from pathlib import Path

TIMEOUT_S = 5.0
STUCK = "cannot be checked now: earlier checks of working directories have not returned (a hung network file system?)"
SLOTS = 64  # checks under way at once: far above what answering submissions needs, and what stuck ones may hold


def problem(workdir: str) -> str | None:
    """What makes `workdir` no working directory for a task ("does not exist", ...), or None."""
    path = Path(workdir)
    if not path.is_absolute():
        return "is not an absolute path"
    try:
        return None if path.is_dir() else "is not a directory" if path.exists() else "does not exist"
    except OSError as e:  # a name too long, a directory the daemon may not search
        return f"cannot be checked ({e.strerror})"


class WorkdirChecks:
    """`problem`, awaited from the event loop."""

    def __init__(self, timeout_s: float = TIMEOUT_S, slots: int = SLOTS) -> None:
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(slots)

    async def problem(self, workdir: str) -> str | None:
        if not Path(workdir).is_absolute():  # no file system asked
            return problem(workdir)
        if not self._slots.acquire(blocking=False):
            return STUCK
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[str | None] = loop.create_future()

        def settle(found: str | None) -> None:
            if not answer.done():  # not timed out meanwhile
                answer.set_result(found)

        def check() -> None:
            try:
                found = problem(workdir)
            finally:
                self._slots.release()
            with suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(settle, found)

        try:
            threading.Thread(target=check, name="carma-workdir", daemon=True).start()
        except RuntimeError:  # no thread to be had (the machine's limit on processes)
            self._slots.release()
            return STUCK
        try:
            return await asyncio.wait_for(answer, self.timeout_s)
        except TimeoutError:
            return f"cannot be checked (no answer within {self.timeout_s:g} s: a hung network file system?)"
