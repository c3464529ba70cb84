"""Answers read from the store and encoded on a thread of their own.

A server's store may hold years of runs and a month of GPU samples: a request for much of them took
seconds to read and encode on the event loop, which answered nobody meanwhile. These answers are read on
a connection of their own (`Store.apart`) and encoded on one thread, one answer at a time: a long one
delays the next such answer, not the daemon.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import TypeVar

from fastapi import HTTPException
from starlette.responses import Response

from carma.server.store import Reads, Store

READS_PER_USER = 2  # one user's long reads under way or waiting: another's wait behind at most these
LISTED_AT_ONCE = 1000  # items a listing builds between two turns of the event loop
T = TypeVar("T")
V = TypeVar("V")


async def in_turns(items: Sequence[T], view: Callable[[T], Iterable[V]]) -> list[V]:
    """What `view` gives of each item, `LISTED_AT_ONCE` items at a time, the event loop answering others in
    between: a listing of 100,000 tasks kept held it 1.4 s. Each item is seen as it is at its turn (`view`
    gives nothing of one that has gone since)."""
    out: list[V] = []
    for start in range(0, len(items), LISTED_AT_ONCE):
        if start:
            await asyncio.sleep(0)
        for item in items[start : start + LISTED_AT_ONCE]:
            out.extend(view(item))
    return out


class AnswersApart:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="carma-answers")
        # listings the loop built: never behind a long read of the store (`carma queue` waited on a month's series)
        self._encoding = ThreadPoolExecutor(max_workers=1, thread_name_prefix="carma-encoding")
        self._reading: Counter[int] = Counter()  # per uid: long reads under way or waiting on the thread

    async def json(self, read: Callable[[Reads], object], uid: int) -> Response:
        """`read`'s answer as JSON; it runs on the thread, so it takes from the daemon's state only what the
        caller copied for it. A user has at most `READS_PER_USER` under way or waiting (429 beyond), counted
        until the thread is done with them, whether their asker still waits or not."""
        if self._reading[uid] >= READS_PER_USER:
            raise HTTPException(429, f"you have {READS_PER_USER} reads of the history or series under way: retry later")

        def answer() -> bytes:
            with self._store.apart() as reads:
                return _encoded(read(reads))

        loop = asyncio.get_running_loop()
        self._reading[uid] += 1
        done = self._pool.submit(answer)
        done.add_done_callback(lambda _: _soon(loop, self._done_reading, uid))
        return Response(await asyncio.wrap_future(done), media_type="application/json")

    def _done_reading(self, uid: int) -> None:
        self._reading[uid] -= 1
        if not self._reading[uid]:
            del self._reading[uid]

    async def encoded(self, value: object) -> Response:
        """`value` (made of the daemon's state on the loop, its own copy) encoded as JSON on a thread of its own."""
        body = await asyncio.get_running_loop().run_in_executor(self._encoding, _encoded, value)
        return Response(body, media_type="application/json")


def _soon(loop: asyncio.AbstractEventLoop, call: Callable[[int], None], uid: int) -> None:
    with suppress(RuntimeError):  # the loop closed meanwhile (the daemon stopped)
        loop.call_soon_threadsafe(call, uid)


def _encoded(value: object) -> bytes:
    return json.dumps(value, allow_nan=False, separators=(",", ":")).encode()
