"""session_server.turns.pipeline over the real app in process: the busy gate of a turn and its release.

The engine is a stand-in the test answers (tests/support/turn_engine.py), so a chat can be held at the engine while
another arrives. Checked: a second chat on a busy single-line session is a 409 before its body is read and never
reaches the engine; a closing session answers 404 even while busy; and the slot is released exactly once on every
way a turn ends -- a reply, the engine's refusal, a malformed reply, a body that is not JSON, the client going away,
the handler cancelled -- after which the next turn gets the slot at once.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import pytest

from session_server.sessions.lifecycle import Lifecycle
from session_server.sessions.session import Claim
from support.bounded import BOUND, bounded, until, user
from support.inprocess_app import client_of
from support.turn_engine import Hangups, chat_path, reply_body, start_chat, turn_app
from trajectory import ModelFamily


class Releases:
    """How many times each claim of the lifecycle was released (Claim.release calls the lifecycle's)."""

    def __init__(self, lifecycle: Lifecycle) -> None:
        self.counts: Counter[int] = Counter()
        self.claims: list[Claim] = []
        release, claim = lifecycle.release, lifecycle.claim

        def counted_release(c: Claim) -> None:
            self.counts[id(c)] += 1
            release(c)

        def recorded_claim(session_id: str) -> Claim:
            made = claim(session_id)
            self.claims.append(made)
            return made

        lifecycle.release = counted_release  # type: ignore[method-assign]
        lifecycle.claim = recorded_claim  # type: ignore[method-assign]

    def each_once(self) -> bool:
        return bool(self.claims) and all(self.counts[id(c)] == 1 for c in self.claims)


async def raw_post(app: Any, path: str, body_arrives: asyncio.Event) -> tuple[int, int]:
    """POST straight to the ASGI app with a body that never arrives unless `body_arrives` is set; (status, how many
    times the app asked for the body)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"server"), (b"content-type", b"application/json"), (b"content-length", b"2")],
             "server": ("server", 80), "client": ("127.0.0.1", 1)}
    asked = 0
    status: list[int] = []

    async def receive() -> dict[str, Any]:
        nonlocal asked
        asked += 1
        await body_arrives.wait()
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            status.append(message["status"])

    await bounded(app(scope, receive, send))
    return status[0], asked


def test_a_second_chat_on_a_busy_single_line_session_is_409_before_its_body(family: ModelFamily) -> None:
    async def main() -> None:
        with turn_app(family, max_segments=1) as (app, _server, engine, session):
            async with client_of(app) as http:
                first = start_chat(http, session.id, user("hi"))
                call = await engine.next_call()
                status, asked = await raw_post(app, chat_path(session.id), asyncio.Event())
                assert (status, asked) == (409, 0)  # refused at once: its body was never waited for
                assert len(engine.generated) == 1  # and nothing of it reached the engine
                call.reply(reply_body(family, call, "Hello."))
                assert (await bounded(first)).status_code == 200

    asyncio.run(main())


def test_a_closing_session_is_404_even_while_a_chat_holds_it(family: ModelFamily) -> None:
    """DELETE waits for the chat in flight; a chat arriving meanwhile hears that the session is gone, not busy."""
    async def main() -> None:
        with turn_app(family, max_segments=1) as (app, server, engine, session):
            holder = server.lifecycle.claim(session.id)  # a chat whose handler lets go only when told
            async with client_of(app) as http:
                deleting = asyncio.create_task(http.delete(f"/sessions/{session.id}"))
                await until(lambda: session.closing)
                late = await bounded(start_chat(http, session.id, user("hi")))
                assert late.status_code == 404 and not deleting.done()
                holder.release()
                assert (await bounded(deleting)).status_code == 204
            assert engine.generated == []

    asyncio.run(main())


ENDINGS = ["reply", "engine refuses", "malformed reply", "not json", "client gone", "handler cancelled"]


@pytest.mark.parametrize("ending", ENDINGS)
def test_the_slot_is_released_exactly_once_however_the_turn_ends(family: ModelFamily, ending: str) -> None:
    async def main() -> None:
        with turn_app(family, max_segments=1) as (app, server, engine, session):
            releases = Releases(server.lifecycle)
            hangups = Hangups(app)
            async with client_of(hangups) as http:  # type: ignore[arg-type]
                path = chat_path(session.id)
                if ending == "not json":
                    turn = asyncio.create_task(http.post(path, content=b"{not json"))
                else:
                    turn = start_chat(http, session.id, user("hi"))
                    call = await engine.next_call()
                    assert session.claims  # held while the engine works
                    if ending == "reply":
                        call.reply(reply_body(family, call, "Hello."))
                    elif ending == "engine refuses":
                        call.reply({"error": {"message": "context too long"}}, status=400)
                    elif ending == "malformed reply":
                        call.reply(b'{"text": "no meta_info"}')
                    elif ending == "client gone":
                        await until(lambda: hangups.watched == 1)
                        hangups.hang_up()
                    else:
                        turn.cancel()
                await asyncio.wait([turn], timeout=BOUND)
                assert turn.done()
                if ending != "handler cancelled":
                    status = turn.result().status_code
                    assert status == {"reply": 200, "engine refuses": 400, "malformed reply": 502,
                                      "not json": 400}.get(ending, status)
                assert releases.each_once() and not session.claims and server.lifecycle.in_flight == 0
                assert session.trajectory.version == (1 if ending == "reply" else 0)  # committed only on a reply
                # The slot is free at once: the next turn is served, not refused as busy.
                history = session.trajectory.messages
                retry = start_chat(http, session.id, *history, user("hi again"))
                call = await engine.next_call()
                call.reply(reply_body(family, call, "Hi."))
                assert (await bounded(retry)).status_code == 200
            assert releases.each_once() and len(releases.claims) == 2

    asyncio.run(main())


def test_a_turn_whose_client_went_away_commits_nothing_and_aborts_its_request(family: ModelFamily) -> None:
    async def main() -> None:
        with turn_app(family) as (app, _server, engine, session):
            hangups = Hangups(app)
            async with client_of(hangups) as http:  # type: ignore[arg-type]
                turn = start_chat(http, session.id, user("hi"))
                call = await engine.next_call()
                await until(lambda: hangups.watched == 1)
                hangups.hang_up()
                await bounded(turn)
            assert engine.aborted == [call.rid]
            assert session.trajectory.num_tokens == 0 and session.trajectory.version == 0
            assert json.loads(call.answer.result().body)["meta_info"]["finish_reason"]["type"] == "abort"

    asyncio.run(main())
