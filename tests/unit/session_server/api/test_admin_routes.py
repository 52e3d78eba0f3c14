"""session_server.api.admin over the real app in process: health, readiness, metrics, the pause modes, continue, the
session listing, and the admin token.

Chats in flight are claims held by handler tasks on the test's loop (tests/unit/session_server/sessions/ test the
claims themselves): a drain must wait for the chats that reached the engine and for no other, abort the rest at its
deadline, `abort` must abort at once, and `in_place` must leave them be and pause the engines instead. A pause is
journaled before it is acknowledged and undone when the engines refuse it. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from session_server.errors import AbortReason, SessionPausedError
from session_server.sessions.journal import JournalUnavailableError
from session_server.sessions.session import Claim
from session_server.state import ServerState
from support.bounded import BOUND, bounded
from support.inprocess_app import StubEngine, client_of, in_process_app
from trajectory import ModelFamily

LONG = 60.0  # a drain deadline the test must never reach


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the loop until `condition` holds (bounded by BOUND)."""
    deadline = time.monotonic() + BOUND
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.001)


class PauseJournal:
    def __init__(self) -> None:
        self.modes: list[str | None] = []
        self.fail = False

    async def paused(self, mode: str | None) -> None:
        if self.fail:
            raise JournalUnavailableError("journal write failed")
        self.modes.append(mode)


class RecordingDrains:
    def __init__(self) -> None:
        self.waited: list[float] = []

    async def wait_all(self, retries_within: float = 0.0) -> None:
        self.waited.append(retries_within)


def chat(server: ServerState, *, admitted: bool = True, release_on_abort: bool = True) -> Claim:
    """A chat in flight on a new session: its handler releases the slot when asked to abort (if so told)."""
    session = server.lifecycle.create(server.new_segments())
    claim = server.lifecycle.claim(session.id)
    if admitted:
        server.lifecycle.admit(claim)
    if release_on_abort:
        claim.on_abort(lambda: asyncio.get_running_loop().call_soon(claim.release))
    return claim


def test_health_is_cheap_and_says_whether_paused(family: ModelFamily) -> None:
    async def main() -> None:
        with in_process_app(family, replica_name="r1") as (app, server):
            async with client_of(app) as http:
                body = (await http.get("/health")).json()
                assert body == {"status": "ok", "instance_id": server.instance_id, "replica": "r1", "paused": False}
                server.lifecycle.pause.restore("drain")
                assert (await http.get("/health")).json()["paused"] is True
                assert server.engine.calls == []  # type: ignore[attr-defined]  # never touches the engine

    asyncio.run(main())


def test_ready_probes_the_engines_now(family: ModelFamily) -> None:
    async def main() -> None:
        engine = StubEngine()
        with in_process_app(family, engine=engine) as (app, server):
            async with client_of(app) as http:
                ok = await http.get("/ready")
                assert ok.status_code == 200 and ok.json()["status"] == "ready"
                assert ok.json()["instance_id"] == server.instance_id and ok.json()["engines"]
                engine.healthy = False
                down = await http.get("/ready")
                assert down.status_code == 503 and down.json()["status"] == "engine_unavailable"
                assert engine.calls == ["ready", "ready"]

    asyncio.run(main())


def test_metrics_are_the_servers_registry_in_prometheus_text(family: ModelFamily) -> None:
    async def main() -> None:
        with in_process_app(family) as (app, server):
            server.metrics.sessions_created.inc(3)
            async with client_of(app) as http:
                reply = await http.get("/metrics")
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
        assert "session_server_sessions_created_total 3.0" in reply.text

    asyncio.run(main())


@pytest.mark.parametrize("path", ["/admin/pause", "/admin/continue"])
def test_the_admin_token_guards_the_admin_routes(family: ModelFamily, path: str) -> None:
    async def main() -> None:
        with in_process_app(family, admin_token="s3cret") as (app, server):
            async with client_of(app) as http:
                for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
                    refused = await http.post(path, headers=headers)
                    assert refused.status_code == 401 and refused.json()["error"]["type"] == "unauthorized"
                    assert (await http.get("/admin/sessions", headers=headers)).status_code == 401
                assert not server.lifecycle.paused  # nothing happened
                good = {"authorization": "Bearer s3cret"}
                assert (await http.post(path, headers=good)).status_code == 200
                assert (await http.get("/admin/sessions", headers=good)).status_code == 200

    asyncio.run(main())


@pytest.mark.parametrize("body", [b'{"mode": "later"}', b'{"mode": 1}', b"[1]", b"{not json"])
def test_an_unknown_pause_mode_is_a_400_and_pauses_nothing(family: ModelFamily, body: bytes) -> None:
    async def main() -> None:
        with in_process_app(family) as (app, server):
            async with client_of(app) as http:
                reply = await http.post("/admin/pause", content=body)
            assert reply.status_code == 400 and not server.lifecycle.paused

    asyncio.run(main())


def test_a_drain_waits_for_chats_at_the_engine_only_and_refuses_new_ones(family: ModelFamily) -> None:
    async def main() -> None:
        drains = RecordingDrains()
        with in_process_app(family, drains=drains, drain_timeout=LONG) as (app, server):
            at_engine = chat(server, release_on_abort=False)
            uploading = chat(server, admitted=False, release_on_abort=False)  # its body is still on the way
            async with client_of(app) as http:
                pausing = asyncio.create_task(http.post("/admin/pause"))  # default mode: drain
                await until(lambda: server.lifecycle.paused)
                with pytest.raises(SessionPausedError):  # new chats: 503 + Retry-After
                    server.lifecycle.claim(server.lifecycle.create(server.new_segments()).id)
                with pytest.raises(SessionPausedError):  # the body that arrives now is refused, not waited for
                    server.lifecycle.admit(uploading)
                await asyncio.sleep(0.01)
                assert not pausing.done() and at_engine.reason is None  # the chat at the engine finishes
                at_engine.release()
                reply = await bounded(pausing)  # while the uploading chat still holds its slot
                assert not uploading.done.is_set()
                uploading.release()
        assert reply.status_code == 200
        assert reply.json() == {"status": "paused", "mode": "drain", "aborted": 0}
        assert len(drains.waited) == 1 and 0 < drains.waited[0] <= LONG  # the rest of the drain's deadline

    asyncio.run(main())


def test_a_drain_aborts_what_is_still_running_at_its_deadline(family: ModelFamily) -> None:
    """The chat's handler only lets go when aborted: the pause returns because the deadline aborts it, however long
    the machine takes to get there."""
    async def main() -> None:
        with in_process_app(family, drain_timeout=0.2) as (app, server):
            stuck = chat(server)
            async with client_of(app) as http:
                reply = await bounded(http.post("/admin/pause", json={"mode": "drain"}))
            assert reply.json() == {"status": "paused", "mode": "drain", "aborted": 1}
            assert stuck.reason is AbortReason.PAUSE and stuck.done.is_set()

    asyncio.run(main())


def test_pause_abort_cuts_every_chat_at_once_and_waits_for_their_handlers(family: ModelFamily) -> None:
    async def main() -> None:
        with in_process_app(family, drain_timeout=LONG) as (app, server):
            chats = [chat(server), chat(server), chat(server, admitted=False)]
            async with client_of(app) as http:
                reply = await bounded(http.post("/admin/pause", json={"mode": "abort"}))
            assert reply.json() == {"status": "paused", "mode": "abort", "aborted": 3}
            assert all(c.reason is AbortReason.PAUSE and c.done.is_set() for c in chats)
            assert server.lifecycle.in_flight == 0

    asyncio.run(main())


def test_pause_in_place_leaves_the_chats_in_the_engines_and_continue_resumes_them(family: ModelFamily) -> None:
    async def main() -> None:
        engine, journal = StubEngine(), PauseJournal()
        with in_process_app(family, engine=engine, journal=journal) as (app, server):
            running = chat(server, release_on_abort=False)
            session = server.registry.sessions()[0]
            async with client_of(app) as http:
                reply = await bounded(http.post("/admin/pause", json={"mode": "in_place"}))
                assert reply.json() == {"status": "paused", "mode": "in_place", "aborted": 0}
                assert running.reason is None and not running.done.is_set()  # still in the engine
                assert engine.calls == ["pause_in_place"]
                assert server.lifecycle.pause.in_place and server.lifecycle.paused
                # A later pause keeps the engines paused in place, and the journal keeps saying so.
                running.release()
                again = await bounded(http.post("/admin/pause", json={"mode": "drain"}))
                assert again.status_code == 200 and server.lifecycle.pause.in_place
                session.last_active = 0.0
                resumed = await http.post("/admin/continue")
            assert resumed.json() == {"status": "running"}
            assert engine.calls == ["pause_in_place", "continue_in_place"]
            assert not server.lifecycle.pause.in_place and not server.lifecycle.paused
            assert session.last_active > 0.0  # the pause does not count as idleness
            assert journal.modes == ["in_place", "in_place", None]

    asyncio.run(main())


def test_a_pause_the_engines_refuse_is_a_502_and_undone_in_the_journal(family: ModelFamily) -> None:
    async def main() -> None:
        engine, journal = StubEngine(), PauseJournal()
        engine.refuse_pause = True
        with in_process_app(family, engine=engine, journal=journal) as (app, server):
            async with client_of(app) as http:
                reply = await http.post("/admin/pause", json={"mode": "in_place"})
            assert reply.status_code == 502
            assert not server.lifecycle.paused and not server.lifecycle.pause.in_place
            assert journal.modes == ["in_place", None]  # a restart must not come back paused

    asyncio.run(main())


def test_continue_the_engines_refuse_leaves_the_server_paused(family: ModelFamily) -> None:
    async def main() -> None:
        engine, journal = StubEngine(), PauseJournal()
        engine.refuse_continue = True
        with in_process_app(family, engine=engine, journal=journal) as (app, server):
            async with client_of(app) as http:
                assert (await http.post("/admin/pause", json={"mode": "in_place"})).status_code == 200
                reply = await http.post("/admin/continue")
            assert reply.status_code == 502
            assert server.lifecycle.paused and server.lifecycle.pause.in_place and journal.modes == ["in_place"]

    asyncio.run(main())


def test_a_pause_the_journal_cannot_write_is_a_503_and_pauses_nothing(family: ModelFamily) -> None:
    async def main() -> None:
        engine, journal = StubEngine(), PauseJournal()
        journal.fail = True
        with in_process_app(family, engine=engine, journal=journal) as (app, server):
            running = chat(server)
            async with client_of(app) as http:
                for mode in ("drain", "abort", "in_place"):
                    reply = await http.post("/admin/pause", json={"mode": mode})
                    assert reply.status_code == 503
            assert not server.lifecycle.paused and running.reason is None and engine.calls == []

    asyncio.run(main())


def test_admin_sessions_lists_the_most_recently_active_first(family: ModelFamily) -> None:
    async def main() -> None:
        with in_process_app(family, replica_name="r2") as (app, server):
            sessions = [server.lifecycle.create(server.new_segments(), {"n": i}) for i in range(4)]
            now = time.monotonic()
            for i, s in enumerate(sessions):
                s.last_active = now - 100 + i  # the last created is the most recently active
            server.lifecycle.claim(sessions[1].id)
            sessions[1].last_active = now - 99
            async with client_of(app) as http:
                listing = (await http.get("/admin/sessions")).json()
                two = (await http.get("/admin/sessions", params={"limit": "2"})).json()
                for bad in ("-1", "x", "1.5"):
                    assert (await http.get("/admin/sessions", params={"limit": bad})).status_code == 400
        assert listing["replica"] == "r2" and listing["total"] == 4
        assert [e["id"] for e in listing["sessions"]] == [s.id for s in reversed(sessions)]
        entry = listing["sessions"][2]
        assert entry["metadata"] == {"n": 1} and entry["in_flight"] is True
        assert (entry["turns"], entry["tokens"]) == (0, 0) and 98 < entry["idle_s"] < 110 and entry["age_s"] >= 0
        assert [e["in_flight"] for e in listing["sessions"]] == [False, False, True, False]
        assert two["total"] == 4 and [e["id"] for e in two["sessions"]] == [sessions[3].id, sessions[2].id]

    asyncio.run(main())
