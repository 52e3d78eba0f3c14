"""A bounded thread pool for stateless CPU work on large bodies, so the event loop keeps answering under load.

Only pure functions of their arguments run here (request decode + TITO prepare, engine request encode, engine
response decode and validation, GET/samples serialization); session state is never written from a worker thread.
Work is routed by the size of the body it parses: a large one (a 1.5 MiB engine reply, a long first-turn history)
goes to the pool so no single request stalls the loop for milliseconds, while a small one runs inline, because a
pool hop (two thread switches and a GIL hand-off, ~50-100 us) costs more than decoding a few KiB and the GIL-bound
work would not run in parallel anyway. `--inline-below-bytes` sets the cut (0 pools everything) and
`--inline-decode` runs every engine-response decode on the loop, so a benchmark can measure what the pool buys.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

DEFAULT_INLINE_BELOW_BYTES = 64 * 1024


class CpuPool:
    def __init__(self, workers: int, *, inline_decode: bool = False,
                 inline_below_bytes: int = DEFAULT_INLINE_BELOW_BYTES) -> None:
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="session-cpu")
        self.inline_decode = inline_decode
        self.inline_below_bytes = inline_below_bytes

    async def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Always on the pool: for work whose cost is not bounded by a body size (serializing a trajectory)."""
        loop = asyncio.get_running_loop()
        if kwargs:
            return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))
        return await loop.run_in_executor(self._executor, fn, *args)

    async def run_sized(self, size: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Inline when the body being processed is smaller than the cut, else on the pool."""
        if size < self.inline_below_bytes:
            return fn(*args, **kwargs)
        return await self.run(fn, *args, **kwargs)

    async def run_decode(self, size: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """The engine-response decode: sized, or always inline with --inline-decode."""
        if self.inline_decode:
            return fn(*args, **kwargs)
        return await self.run_sized(size, fn, *args, **kwargs)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
