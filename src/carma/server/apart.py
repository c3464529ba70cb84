"""Answers read from the store and encoded on a thread of their own.

A server's store may hold years of runs and a month of GPU samples: a request for much of them took
seconds to read and encode on the event loop, which answered nobody meanwhile. These answers are read on
a connection of their own (`Store.apart`) and encoded on one thread, one answer at a time: a long one
delays the next such answer, not the daemon.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from starlette.responses import Response

from carma.server.store import Reads, Store


class AnswersApart:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="carma-answers")

    async def json(self, read: Callable[[Reads], object]) -> Response:
        """`read`'s answer as JSON; it runs on the thread, so it takes from the daemon's state only what the
        caller copied for it."""

        def answer() -> bytes:
            with self._store.apart() as reads:
                return json.dumps(read(reads), allow_nan=False, separators=(",", ":")).encode()

        body = await asyncio.get_running_loop().run_in_executor(self._pool, answer)
        return Response(body, media_type="application/json")
