"""`run(main)`: `asyncio.run` on an event loop whose clock jumps to its next timer whenever nothing else can happen
(looptime): sleeps, backoffs, graces and deadlines cost no real time, and the loop's clock reads exactly what the
code waited. For scenarios whose every party lives on the loop (no sockets, no other process): with nothing to wait
for but a timer, the clock moves on at once, so a reply from outside the loop would come too late for its deadline."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import looptime

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    with asyncio.Runner(loop_factory=looptime.new_event_loop) as runner:
        return runner.run(main)
