"""Folders the daemon no longer needs (a forgotten task's run dirs), deleted off the scheduling loop.

A task may leave millions of files in its run dir: deleting them where the daemon forgets the task stopped
the loop (1.2 s for 200,000 files). A folder thrown away is renamed aside at once (no lookup finds it from
then on) and deleted by a background thread; one a stopped daemon had not deleted yet is deleted after
its next start.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import shutil
import threading
from pathlib import Path

log = logging.getLogger("carma.server")

ASIDE = ".thrown-"  # the prefix of a folder waiting for its deletion, in the folder it was in


class Trash:
    """Deletes the folders thrown away in `folder`, one at a time, on a thread of its own."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._waiting: queue.SimpleQueue[tuple[Path, str]] = queue.SimpleQueue()
        self._pending = 0  # thrown away and not yet dealt with (deleted, or the failure said)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        try:
            left = sorted(path for path in folder.iterdir() if path.name.startswith(ASIDE))
        except OSError:  # no such folder yet: nothing was thrown away
            left = []
        for path in left:
            self._delete_later(path, str(path))

    def throw(self, name: str, what: str) -> None:
        """Delete `folder/name` (`what` names it in a warning), if there: renamed aside now, deleted soon."""
        aside = self.folder / f"{ASIDE}{name}-{secrets.token_hex(4)}"  # never one thrown before and still there
        try:
            os.rename(self.folder / name, aside)
        except FileNotFoundError:
            return
        except OSError as e:
            log.warning("could not delete %s: %s", what, e)
            return
        self._delete_later(aside, what)

    @property
    def pending(self) -> int:
        """How many folders thrown away are still to be deleted."""
        return self._pending

    def _delete_later(self, path: Path, what: str) -> None:
        with self._lock:
            self._pending += 1
            if self._thread is None:  # a daemon thread: a stop never waits for a deletion, the next start ends it
                self._thread = threading.Thread(target=self._delete, name="carma-trash", daemon=True)
                self._thread.start()
        self._waiting.put((path, what))

    def _delete(self) -> None:
        while True:
            path, what = self._waiting.get()
            try:
                shutil.rmtree(path)
            except FileNotFoundError:
                pass
            except (OSError, RecursionError) as e:  # a tree deeper than the interpreter's stack, left by a task
                log.warning("could not delete %s: %s", what, e)
            finally:
                with self._lock:
                    self._pending -= 1
