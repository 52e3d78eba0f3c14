"""A test hook that holds `/close_session` calls unanswered (`POST /sim/hold_closes {"hold": true}`) until released.

Why: a DELETE must never wait for the engine to close its engine session (the session server closes it in the
background). With the closes held, a DELETE that waited would stay blocked, whatever the machine's speed: a test
checks that every DELETE answered while the engine had answered none of the closes (`answered == 0`), then releases
them and waits for the engine's books to reach zero. A held close is carried out when it is released, also when its
caller has given up on it meanwhile (as an engine that was only slow would).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CloseGate:
    received: int = 0  # /close_session calls that arrived
    answered: int = 0  # ... and were carried out and answered
    _open: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._open.set()

    def hold(self, held: bool) -> None:
        if held:
            self._open.clear()
        else:
            self._open.set()

    async def passage(self) -> None:
        """Wait while closes are held."""
        self.received += 1
        await self._open.wait()

    def state(self) -> dict[str, Any]:
        return {"hold": not self._open.is_set(), "received": self.received, "answered": self.answered,
                "waiting": self.received - self.answered}
