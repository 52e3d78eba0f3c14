"""A bounded thread pool for stateless CPU work, so the event loop keeps answering (/health, 409s) under load.

Only pure functions of their arguments run here (request decode, engine request encode, engine response decode and
validation, reply and samples serialization); session state is never touched from a worker thread. msgspec and the
tokenizers release or barely hold the GIL for large inputs, and even when they do not, moving a 1.5 MiB decode off the
loop bounds how long any one request can stall the others. `inline` (--inline-decode) runs the response decode on the
loop instead, so a benchmark can measure what the pool buys.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class CpuPool:
    def __init__(self, workers: int, *, inline_decode: bool = False) -> None:
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="session-cpu")
        self.inline_decode = inline_decode

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        loop = asyncio.get_running_loop()
        if kwargs:
            return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))
        return await loop.run_in_executor(self._executor, fn, *args)

    async def run_decode(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """The engine-response decode: pooled unless --inline-decode."""
        if self.inline_decode:
            return fn(*args, **kwargs)
        return await self.run(fn, *args, **kwargs)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
