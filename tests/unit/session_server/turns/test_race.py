"""session_server.turns.race: what ends a chat's engine call first, and that the losers leave nothing behind.

`race` on its own seams (a future for the engine call, a recording client hook, a real Claim): each of the four
endings, the first of two that land in one loop pass wins, a call that finished before the race began counts as
finished, and on every way out -- the caller cancelled included -- the work's callback, the client watch, the claim
subscription and the timer are gone. Then in a turn (the real app in process, tests/support/turn_engine.py): the
engine call that loses is aborted by its rid, and an engine reply that wins is not. No verdict reads a clock: a
deadline is 0 s (due at once) or an hour (never reached).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from session_server.errors import AbortReason
from session_server.sessions.session import Claim
from session_server.turns.race import Ending, race
from support.bounded import bounded, until, user
from support.inprocess_app import client_of
from support.turn_engine import reply_body, start_chat, turn_app
from trajectory import ModelFamily

NEVER = 3600.0


class Work(asyncio.Future[Any]):
    """The engine call: a future that counts the done-callbacks it holds."""

    def __init__(self) -> None:
        super().__init__()
        self.callbacks = 0

    def add_done_callback(self, fn: Any, *, context: Any = None) -> None:
        self.callbacks += 1
        super().add_done_callback(fn, context=context)

    def remove_done_callback(self, fn: Any) -> int:
        removed = super().remove_done_callback(fn)
        self.callbacks -= removed
        return removed


class Client:
    """A client hook (http/disconnect.py `Disconnects`): `gone()` is the connection lost."""

    def __init__(self) -> None:
        self.watchers: list[Callable[[], None]] = []

    def __call__(self, callback: Callable[[], None]) -> Callable[[], None]:
        self.watchers.append(callback)
        return lambda: self.watchers.remove(callback)

    def gone(self) -> None:
        for callback in list(self.watchers):
            callback()


def claim() -> Claim:
    return Claim(None, lambda c: None, 1)  # type: ignore[arg-type]  # the race reads only its abort channel


def pending_timers() -> int:
    return sum(not h.cancelled() for h in asyncio.get_running_loop()._scheduled)  # type: ignore[attr-defined]


async def run(start: Callable[[Work, Client, Claim], None], deadline: float = NEVER,
              then: Callable[[Work, Client, Claim], None] | None = None) -> Ending:
    """`start` before the race, `then` once it waits; the ending, after checking that nothing of the race is left."""
    work, client, holder = Work(), Client(), claim()
    timers = pending_timers()
    start(work, client, holder)
    racing = asyncio.ensure_future(race(work, client, holder, deadline))
    await asyncio.sleep(0)
    if then is not None:
        then(work, client, holder)
    ending = await bounded(racing)
    held = 0 if work.done() else work.callbacks  # a finished future has run (and dropped) its callbacks
    assert held == 0 and client.watchers == [] and holder._on_abort == []
    assert pending_timers() == timers  # the deadline's timer is cancelled
    work.cancel()
    return ending


def nothing(*_: Any) -> None:
    return None


def test_the_work_finishing_first() -> None:
    assert asyncio.run(run(nothing, then=lambda w, c, h: w.set_result("reply"))) is Ending.FINISHED


def test_the_client_going_away_first() -> None:
    assert asyncio.run(run(nothing, then=lambda w, c, h: c.gone())) is Ending.DISCONNECTED


def test_the_claim_aborted_first() -> None:
    ending = asyncio.run(run(nothing, then=lambda w, c, h: h.abort(AbortReason.DELETE)))
    assert ending is Ending.ABORTED


def test_the_deadline_first() -> None:
    assert asyncio.run(run(nothing, deadline=0.0)) is Ending.TIMED_OUT
    assert asyncio.run(run(nothing, deadline=-5.0)) is Ending.TIMED_OUT  # already past: due at once


def test_of_two_endings_in_one_loop_pass_the_first_wins() -> None:
    def gone_then_aborted(w: Work, c: Client, h: Claim) -> None:
        c.gone()
        h.abort(AbortReason.PAUSE)
        w.set_result("reply")

    def aborted_then_gone(w: Work, c: Client, h: Claim) -> None:
        h.abort(AbortReason.PAUSE)
        c.gone()

    assert asyncio.run(run(nothing, then=gone_then_aborted)) is Ending.DISCONNECTED
    assert asyncio.run(run(nothing, then=aborted_then_gone)) is Ending.ABORTED


def test_work_done_before_the_race_began_counts_as_finished() -> None:
    """Even when the claim was aborted and the deadline passed meanwhile: the reply is there, the caller reads it."""
    def done_and_aborted(w: Work, c: Client, h: Claim) -> None:
        w.set_result("reply")
        h.abort(AbortReason.SHUTDOWN)

    assert asyncio.run(run(done_and_aborted, deadline=0.0)) is Ending.FINISHED


def test_an_abort_before_the_race_began_ends_it_at_once() -> None:
    ending = asyncio.run(run(lambda w, c, h: h.abort(AbortReason.EXPIRY)))
    assert ending is Ending.ABORTED


def test_a_cancelled_race_leaves_nothing_behind() -> None:
    async def main() -> None:
        work, client, holder = Work(), Client(), claim()
        timers = pending_timers()
        racing = asyncio.ensure_future(race(work, client, holder, NEVER))
        await asyncio.sleep(0)
        assert work.callbacks == 1 and len(client.watchers) == 1 and len(holder._on_abort) == 1
        racing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await racing
        assert work.callbacks == 0 and client.watchers == [] and holder._on_abort == []
        assert pending_timers() == timers and not work.done()  # the work itself is the caller's to end

    asyncio.run(main())


# -- the race in a turn ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loser", ["deadline", "delete"])
def test_an_engine_call_that_loses_is_aborted_by_its_rid(family: ModelFamily, loser: str) -> None:
    async def main() -> None:
        timeout = 0.001 if loser == "deadline" else NEVER  # a deadline the engine's reply can never beat: none comes
        with turn_app(family, request_timeout=timeout) as (app, _server, engine, session):
            async with client_of(app) as http:
                turn = start_chat(http, session.id, user("hi"))
                call = await engine.next_call()
                if loser == "delete":
                    assert (await bounded(http.delete(f"/sessions/{session.id}"))).status_code == 204
                reply = await bounded(turn)
                await until(lambda: engine.aborted != [])
            assert reply.status_code == (504 if loser == "deadline" else 404)
            assert engine.aborted == [call.rid]
            assert session.trajectory.version == 0

    asyncio.run(main())


def test_an_engine_reply_that_wins_is_committed_and_aborts_nothing(family: ModelFamily) -> None:
    async def main() -> None:
        with turn_app(family) as (app, _server, engine, session):
            async with client_of(app) as http:
                turn = start_chat(http, session.id, user("hi"))
                call = await engine.next_call()
                call.reply(reply_body(family, call, "Hello."))
                reply = await bounded(turn)
            assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "Hello."
            assert engine.aborted == [] and session.trajectory.version == 1

    asyncio.run(main())
