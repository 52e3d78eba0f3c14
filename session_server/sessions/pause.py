"""The pause for weight updates, in one owner: its state, its modes, its journal row and the engines' own pause.

    running --pause(drain | abort)--> paused --continue--> running
    running --pause(in_place)--> paused, engines paused in place --continue--> (engines continued) running

Every mode refuses new chats (503 + Retry-After, `Lifecycle.check_accepting`); they differ in the chats in flight:
`drain` waits for the ones that reached the engine, for at most --drain-timeout, then aborts the rest (a chat still
uploading its body is refused when it arrives, `Lifecycle.admit`); `abort` aborts them at once (503 + Retry-After,
nothing committed; the agent retries the same turn after continue); `in_place` leaves them in the engine (SGLang's
`/pause_generation` mode `in_place` on every worker: requests keep their KV) while the trainer updates the weights,
and continue resumes the engines, so those replies record which tokens each weight version sampled. Engines paused in
place stay so until a continue, whatever mode a later pause asks for. A pause while paused runs its mode again (a
drain after an abort waits for what is in flight now); a continue while running is harmless.

With --journal the pause is durable: it is journaled before it is acknowledged (a failed write is a 503 and nothing
is paused; an in_place pause the engines refuse is a 502 and the row is put back), and a replica restarted during it
comes back paused in the same mode (`restore`), refusing new chats until continue: a weight update in progress never
gets traffic from a replica that forgot it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Literal, Protocol

from session_server.engine.drains import EngineDrains
from session_server.engine.placement import EnginePlacement
from session_server.errors import AbortReason
from session_server.sessions.journal import Journal
from session_server.sessions.registry import Registry
from session_server.sessions.session import Claim
from trajectory.errors import InvariantError

PauseMode = Literal["drain", "abort", "in_place"]
MODES: tuple[PauseMode, ...] = ("drain", "abort", "in_place")


class Chats(Protocol):
    """The chats in flight, as the pause acts on them (sessions/lifecycle.py)."""

    def abort_all(self, reason: AbortReason) -> list[Claim]: ...
    async def wait_idle(self, admitted_only: bool = False) -> None: ...


class Pause:
    """The server's pause: `mode` is the pause in force (None: running), written here only."""

    def __init__(self, chats: Chats, registry: Registry, *, engines: EnginePlacement | None = None,
                 journal: Journal | None = None, drains: EngineDrains | None = None) -> None:
        self.mode: PauseMode | None = None
        self.in_place = False  # the engines are paused in place too (until a continue)
        self._chats = chats
        self._registry = registry
        self._engines = engines
        self._journal = journal
        self._drains = drains

    @property
    def active(self) -> bool:
        """New chats are refused."""
        return self.mode is not None

    def restore(self, mode: str | None) -> None:
        """The pause a journal says was in force when the process stopped (journal recovery, app.py): held again as
        it was, engines included (an in_place pause is the engines', and they kept it across our restart)."""
        self.mode = None if mode is None else next((m for m in MODES if m == mode), "drain")
        self.in_place = self.mode == "in_place"

    async def pause(self, mode: PauseMode, drain_timeout: float) -> int:
        """Pause in `mode` (`drain_timeout`: the drain's bound); returns how many chats were aborted."""
        journal, previous = self._journal, self.mode
        # What the journal says is what a restart does: engines paused in place stay so whatever `mode` is now.
        if journal is not None:
            await journal.paused("in_place" if self.in_place else mode)
        if mode == "in_place":
            if self._engines is None:
                raise InvariantError("a pause in place needs the engines")
            try:
                await self._engines.pause_in_place()  # a refusal is a 502 and nothing is paused
            except BaseException:
                if journal is not None:
                    await journal.paused("in_place" if self.in_place else previous)
                raise
            self.mode, self.in_place = mode, True
            return 0
        self.mode = "in_place" if self.in_place else mode
        return await self._settle(mode == "abort", drain_timeout)

    async def _settle(self, abort: bool, drain_timeout: float) -> int:
        """The chats in flight: aborted at once, or drained within `drain_timeout` and the rest aborted."""
        chats = self._chats
        deadline = time.monotonic() + drain_timeout
        aborted = len(chats.abort_all(AbortReason.PAUSE)) if abort else 0
        try:
            # A drain waits for the chats that reached the engine, but not forever: an engine that never answers must
            # not hold a weight update. Past the deadline the rest are aborted (503 + Retry-After, nothing committed)
            # like mode=abort. Chats still uploading their bodies are not waited for: they are refused when their
            # body arrives (Lifecycle.admit).
            await asyncio.wait_for(chats.wait_idle(admitted_only=True), drain_timeout)
        except TimeoutError:
            aborted = len(chats.abort_all(AbortReason.PAUSE))
            await chats.wait_idle()
        if self._drains is not None:
            # Aborted chats answer at once and their engine requests end in the background (engine/drains.py); the
            # pause returns once those have ended too (each drain is bounded), so the engine is quiet for the update;
            # aborts the engine did not answer are retried until it does, waited for until the drain's deadline.
            await self._drains.wait_all(retries_within=deadline - time.monotonic())
        return aborted

    async def resume(self) -> None:
        """Continue: the engines first when they are paused in place (a refusal is a 502 and the server stays
        paused), then the journal (a failure is a 503 and the server stays paused, as the journal says)."""
        if self.in_place:
            assert self._engines is not None  # only a pause with engines, or a journal's, pauses in place
            await self._engines.continue_in_place()
            self.in_place = False
        if self._journal is not None:
            await self._journal.paused(None)
        self.mode = None
        self._registry.touch_all()  # the pause does not count as idleness (see sessions/sweeper.py)
