"""Answers read from the store and encoded on a thread of their own.

A server's store may hold years of runs and a month of GPU samples: a request for much of them took
seconds to read and encode on the event loop, which answered nobody meanwhile. These answers are read on
a connection of their own (`Store.apart`) and encoded on one thread, one answer at a time: a long one
delays the next such answer, not the daemon.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from starlette.responses import Response

from carma.server.store import Reads, Store

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

    async def json(self, read: Callable[[Reads], object]) -> Response:
        """`read`'s answer as JSON; it runs on the thread, so it takes from the daemon's state only what the
        caller copied for it."""

        def answer() -> bytes:
            with self._store.apart() as reads:
                return _encoded(read(reads))

        body = await asyncio.get_running_loop().run_in_executor(self._pool, answer)
        return Response(body, media_type="application/json")

    async def encoded(self, value: object) -> Response:
        """`value` (made of the daemon's state on the loop, its own copy) encoded as JSON on a thread of its own."""
        body = await asyncio.get_running_loop().run_in_executor(self._encoding, _encoded, value)
        return Response(body, media_type="application/json")


def _encoded(value: object) -> bytes:
    return json.dumps(value, allow_nan=False, separators=(",", ":")).encode()
