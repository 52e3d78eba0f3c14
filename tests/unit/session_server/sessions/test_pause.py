"""session_server.sessions.pause: the pause state machine without HTTP.

The chats in flight, the engines, the journal and the drains are recording stand-ins in one ordered log, so each
transition is checked for what it does and in which order: running -> paused (drain, abort, in_place) -> running, a
pause while paused in another mode, continue twice or without a pause, and the journal row put back when the engines
refuse. Every wait is bounded (`bounded`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from session_server.errors import AbortReason, EngineUnavailableError
from session_server.sessions.journal import JournalUnavailableError
from session_server.sessions.pause import Pause
from session_server.sessions.registry import Registry
from support.bounded import bounded

LONG = 60.0  # a drain deadline no test reaches unless it means to


class World:
    """Chats in flight (`busy` of them hold on until aborted, or until `finish` ends them), the engines, the
    journal and the drains, recording into `log`."""

    def __init__(self, busy: int = 0) -> None:
        self.log: list[tuple[str, Any]] = []
        self.busy = busy
        self.idle = asyncio.Event()
        if not busy:
            self.idle.set()
        self.refuse_pause = self.refuse_continue = self.journal_fails = False

    # the chats (Lifecycle)
    def abort_all(self, reason: AbortReason) -> list[Any]:
        aborted = [reason] * self.busy
        self.log.append(("abort_all", len(aborted)))
        asyncio.get_running_loop().call_soon(self.finish)  # each handler lets go once it sees the abort
        return aborted

    async def wait_idle(self, admitted_only: bool = False) -> None:
        await self.idle.wait()

    def finish(self) -> None:
        self.busy = 0
        self.idle.set()

    # the engines (EnginePlacement)
    async def pause_in_place(self) -> None:
        self.log.append(("engines", "pause"))
        if self.refuse_pause:
            raise EngineUnavailableError("the engine refused /pause_generation")

    async def continue_in_place(self) -> None:
        self.log.append(("engines", "continue"))
        if self.refuse_continue:
            raise EngineUnavailableError("the engine refused /continue_generation")

    async def pause_cutting(self, deadline: float) -> None:
        self.log.append(("engines", "cut"))

    async def learn_versions(self, version: str | None) -> bool:
        return False

    # the journal
    async def paused(self, mode: str | None) -> None:
        if self.journal_fails:
            raise JournalUnavailableError("disk full")
        self.log.append(("journal", mode))

    # the drains
    async def wait_all(self, retries_within: float = 0.0) -> None:
        self.log.append(("drains", None))

    def pause(self, registry: Registry | None = None) -> Pause:
        return Pause(self, registry if registry is not None else Registry(), engines=self, journal=self, drains=self)  # type: ignore[arg-type]


def run(coro: Any) -> Any:
    return asyncio.run(bounded(coro))


def test_drain_waits_for_the_chats_then_the_drains_and_continue_resumes() -> None:
    async def main() -> None:
        world = World(busy=2)
        pause = world.pause()
        draining = asyncio.ensure_future(pause.pause("drain", LONG))
        await asyncio.sleep(0)
        assert pause.active and pause.mode == "drain" and not draining.done()  # new chats refused at once
        world.finish()
        assert await draining == 0
        assert world.log == [("journal", "drain"), ("drains", None)]
        await pause.resume()
        assert not pause.active and world.log[-1] == ("journal", None)

    run(main())


def test_a_drain_past_its_deadline_aborts_the_rest() -> None:
    world = World(busy=3)
    pause = world.pause()
    assert run(pause.pause("drain", 0.0)) == 3  # a chat that never ends is aborted at the deadline, whatever the pace
    assert world.log == [("journal", "drain"), ("abort_all", 3), ("drains", None)]


def test_abort_aborts_at_once() -> None:
    world = World(busy=2)
    pause = world.pause()
    assert run(pause.pause("abort", LONG)) == 2
    assert world.log == [("journal", "abort"), ("abort_all", 2), ("drains", None)]
    assert pause.mode == "abort" and not pause.in_place


def test_in_place_leaves_the_chats_and_pauses_the_engines_until_continue() -> None:
    async def main() -> None:
        world = World(busy=1)
        pause = world.pause()
        assert await pause.pause("in_place", LONG) == 0
        assert world.busy == 1 and pause.in_place and pause.mode == "in_place"
        assert world.log == [("journal", "in_place"), ("engines", "pause")]
        await pause.resume()
        assert world.log[2:] == [("engines", "continue"), ("journal", None)]
        assert not pause.active and not pause.in_place

    run(main())


def test_continue_without_a_pause_and_twice_is_harmless_and_stops_the_idle_clock() -> None:
    async def main() -> None:
        world, registry = World(), Registry()
        pause = world.pause(registry)
        touched: list[bool] = []
        registry.touch_all = lambda: touched.append(True)  # type: ignore[method-assign]
        await pause.resume()
        await pause.resume()
        assert world.log == [("journal", None), ("journal", None)] and touched == [True, True]
        assert not pause.active

    run(main())


def test_a_pause_twice_in_one_mode_is_the_same_pause() -> None:
    async def main() -> None:
        world = World()
        pause = world.pause()
        for mode in ("drain", "drain"):
            assert await pause.pause(mode, LONG) == 0
        assert pause.mode == "drain"
        assert await pause.pause("in_place", LONG) == 0
        assert await pause.pause("in_place", LONG) == 0  # the engines are asked again; they answer alike
        await pause.resume()
        assert world.log == [("journal", "drain"), ("drains", None), ("journal", "drain"), ("drains", None),
                             ("journal", "in_place"), ("engines", "pause"), ("journal", "in_place"),
                             ("engines", "pause"), ("engines", "continue"), ("journal", None)]

    run(main())


@pytest.mark.parametrize(("later", "deadline"), [("drain", 0.0), ("abort", LONG)])
def test_engines_paused_in_place_stay_so_whatever_a_later_pause_asks(later: str, deadline: float) -> None:
    async def main() -> None:
        world = World()
        pause = world.pause()
        await pause.pause("in_place", LONG)
        world.busy = 1
        world.idle.clear()
        aborted = await pause.pause(later, deadline)  # type: ignore[arg-type]
        assert aborted == 1 and pause.in_place and pause.mode == "in_place"
        assert world.log[2] == ("journal", "in_place")  # a restart comes back paused in place
        await pause.resume()
        assert world.log[-2:] == [("engines", "continue"), ("journal", None)]

    run(main())


def test_a_pause_in_place_after_a_drain_pauses_the_engines() -> None:
    async def main() -> None:
        world = World()
        pause = world.pause()
        await pause.pause("drain", LONG)
        await pause.pause("in_place", LONG)
        assert pause.in_place and world.log[-2:] == [("journal", "in_place"), ("engines", "pause")]

    run(main())


@pytest.mark.parametrize("before", [None, "drain", "in_place"])
def test_a_pause_the_engines_refuse_puts_the_journal_back_and_changes_nothing(before: str | None) -> None:
    async def main() -> None:
        world = World()
        pause = world.pause()
        if before is not None:
            await pause.pause(before, LONG)  # type: ignore[arg-type]
        world.refuse_pause = True
        with pytest.raises(EngineUnavailableError):
            await pause.pause("in_place", LONG)
        assert (pause.mode, pause.in_place) == (before, before == "in_place")
        assert world.log[-1] == ("journal", before)

    run(main())


def test_a_continue_the_engines_refuse_stays_paused_in_place() -> None:
    async def main() -> None:
        world = World()
        pause = world.pause()
        await pause.pause("in_place", LONG)
        world.refuse_continue = True
        with pytest.raises(EngineUnavailableError):
            await pause.resume()
        assert pause.active and pause.in_place and world.log[-1] == ("engines", "continue")

    run(main())


def test_a_journal_that_cannot_write_pauses_nothing() -> None:
    async def main() -> None:
        world = World(busy=1)
        world.journal_fails = True
        pause = world.pause()
        for mode in ("drain", "abort", "in_place"):
            with pytest.raises(JournalUnavailableError):
                await pause.pause(mode, LONG)  # type: ignore[arg-type]
        assert not pause.active and world.busy == 1 and world.log == []

    run(main())


def test_restore_holds_the_journals_pause() -> None:
    world = World()
    pause = world.pause()
    for mode, expected in (("in_place", ("in_place", True)), ("abort", ("abort", False)), (None, (None, False)),
                           ("something-newer", ("drain", False))):
        pause.restore(mode)
        assert (pause.mode, pause.in_place) == expected
        assert pause.active is (mode is not None)
    assert world.log == []  # restoring touches neither the engines nor the journal


def test_a_cutting_pause_cuts_the_engines_and_holds_cut_turns_until_continue() -> None:
    """--straddled-replies recompute: in_place cuts the engines' replies (mode abort), and a cut turn's wait for the
    pause to end returns only once the pause is continued."""
    async def main() -> None:
        world = World()
        pause = Pause(world, Registry(), engines=world, journal=world, drains=world,  # type: ignore[arg-type]
                      cut_replies=True)
        assert await pause.wait_running(0.01)
        await pause.pause("in_place", 1.0)
        assert ("engines", "cut") in world.log and ("engines", "pause") not in world.log
        waiter = asyncio.ensure_future(pause.wait_running(30.0))
        assert not await pause.wait_running(0.01) and not waiter.done()
        await pause.resume()
        assert await asyncio.wait_for(waiter, 5.0)
        assert world.log[-2:] == [("engines", "continue"), ("journal", None)]

    asyncio.run(main())
