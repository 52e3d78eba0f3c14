"""What the server's in-process unit tests share: a bound on every wait, and the message they append.

BOUND only turns a hang into a failure: every wait in those tests ends in milliseconds when the code is right, and
whatever the code must not wait out is made far longer than BOUND by construction.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
BOUND = 10.0  # seconds


async def bounded(awaitable: Awaitable[T]) -> T:
    return await asyncio.wait_for(awaitable, BOUND)


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the loop until `condition` holds (bounded by BOUND)."""
    deadline = time.monotonic() + BOUND
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.001)


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}
