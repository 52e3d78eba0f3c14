"""session_server.api.sessions over the real app in process: create, inspect, delete, and the model list.

Sessions hold real committed turns (the real Qwen3 tokenizer, tests/support/tito.py's engine stand-in), so GET shows
what a trainer would read; DELETE of a session with a chat in flight is checked to wait for that chat's handler, and
the model routes to ask the engine for nothing but its read-only list.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from session_server.engine.client import EngineReply
from session_server.errors import AbortReason
from session_server.sessions.journal import JournalUnavailableError, SessionInfo
from session_server.sessions.session import Session
from support.bounded import bounded, user
from support.inprocess_app import StubEngine, client_of, in_process_app
from support.tito import Reply, generate
from trajectory import ModelFamily


def turn(session: Session, request: list[dict[str, Any]], text: str) -> int:
    """Commit one turn (as a chat would) and return its segment."""
    segments = session.segments
    plan = segments.reserve(segments.prepare(request, busy=session.busy_segments()))
    segments.commit(plan, *generate(segments.main.family, plan.turn, Reply(text), rid=f"rid-{text}"))
    return plan.segment


def test_create_takes_optional_metadata_bounded_by_its_encoded_size(family: ModelFamily) -> None:
    async def main() -> None:
        with in_process_app(family, replica_name="r1", max_metadata_bytes=64) as (app, server):
            async with client_of(app) as http:
                bare = await http.post("/sessions")
                meta = await http.post("/sessions", json={"metadata": {"episode": 3, "task": "ü"}})
                null = await http.post("/sessions", json={"metadata": None})
                not_object = await http.post("/sessions", json={"metadata": [1]})
                too_big = await http.post("/sessions", json={"metadata": {"k": "x" * 60}})
                too_long_body = await http.post("/sessions", content=b" " * 2000 + b"{}")
                not_json = await http.post("/sessions", content=b"{metadata")
            for reply in (bare, meta, null):
                assert reply.status_code == 200 and re.fullmatch(r"r1\.[0-9a-f]{32}", reply.json()["session_id"])
            assert server.registry.require(meta.json()["session_id"]).metadata == {"episode": 3, "task": "ü"}
            assert server.registry.require(null.json()["session_id"]).metadata == {}
            assert not_object.status_code == 400 and too_big.status_code == 413 and "64 bytes" in too_big.text
            assert too_long_body.status_code == 413 and not_json.status_code == 400
            assert len(server.registry) == 3

    asyncio.run(main())


class FailingJournal:
    async def created(self, info: SessionInfo) -> None:
        raise JournalUnavailableError("journal write failed")


def test_create_is_refused_when_full_or_not_on_disk(family: ModelFamily) -> None:
    async def main() -> None:
        with in_process_app(family, max_sessions=1, retry_after=4) as (app, server):
            async with client_of(app) as http:
                assert (await http.post("/sessions")).status_code == 200
                full = await http.post("/sessions")
            assert full.status_code == 503 and full.headers["retry-after"] == "4"
            assert full.json()["error"]["type"] == "too_many_sessions" and len(server.registry) == 1
        with in_process_app(family, journal=FailingJournal()) as (app, server):
            async with client_of(app) as http:
                refused = await http.post("/sessions")
            assert refused.status_code == 503 and len(server.registry) == 0  # no id without the session on disk

    asyncio.run(main())


def test_get_shows_every_segment_and_which_is_busy(family: ModelFamily) -> None:
    async def main() -> None:
        with in_process_app(family) as (app, server):
            session = server.lifecycle.create(server.new_segments(), {"episode": 1})
            turn(session, [user("solve")], "first")
            turn(session, [*session.trajectory.messages, user("more")], "second")
            assert turn(session, [user("a side request")], "side") == 1
            claim = server.lifecycle.claim(session.id)
            server.lifecycle.bind(claim, session.segments.prepare(
                [*session.segments.get(1).trajectory.messages, user("more side")]))
            async with client_of(app) as http:
                body = (await http.get(f"/sessions/{session.id}")).json()
                unknown = await http.get("/sessions/" + "0" * 32)
            main_traj, side = session.trajectory, session.segments.get(1).trajectory
            assert body["session_id"] == session.id and body["metadata"] == {"episode": 1}
            assert body["busy"] is True and body["created_at"] == session.created_at
            assert body["token_ids"] == main_traj.token_ids.tolist() and len(body["records"]) == 2
            assert body["messages"] == main_traj.messages and body["nbytes"] == session.segments.nbytes
            assert "mismatch_report" in body
            assert [(s["segment"], s["busy"], s["num_turns"], s["num_tokens"]) for s in body["segments"]] == [
                (0, False, 2, main_traj.num_tokens), (1, True, 1, side.num_tokens)]
            assert body["segments"][1]["reason"] == "new_conversation"
            assert body["segment_trajectories"]["1"]["token_ids"] == side.token_ids.tolist()
            assert unknown.status_code == 404

    asyncio.run(main())


def test_delete_waits_for_the_chat_in_flight_then_leaves_a_tombstone(family: ModelFamily) -> None:
    async def main() -> None:
        with in_process_app(family) as (app, server):
            session = server.lifecycle.create(server.new_segments())
            claim = server.lifecycle.claim(session.id)
            aborted = asyncio.Event()
            claim.on_abort(aborted.set)
            async with client_of(app) as http:
                deleting = asyncio.create_task(http.delete(f"/sessions/{session.id}"))
                await bounded(aborted.wait())
                assert claim.reason is AbortReason.DELETE
                # Closing already: the session's routes answer 404 at once, while DELETE waits for the handler.
                busy_get = await http.get(f"/sessions/{session.id}")
                assert busy_get.status_code == 404 and "being deleted" in busy_get.text
                assert not deleting.done() and server.registry.get(session.id) is session
                claim.release()
                deleted = await bounded(deleting)
                after = await http.get(f"/sessions/{session.id}")
                again = await http.delete(f"/sessions/{session.id}")
            assert deleted.status_code == 204 and deleted.content == b""
            assert after.status_code == 404 and "was deleted" in after.json()["error"]["message"]
            assert again.status_code == 404 and server.registry.get(session.id) is None
            assert "forget" in server.engine.calls  # type: ignore[attr-defined]  # no longer counted on its worker

    asyncio.run(main())


def test_the_model_list_is_the_engines_as_it_came(family: ModelFamily) -> None:
    async def main() -> None:
        engine = StubEngine()
        with in_process_app(family, engine=engine) as (app, server):
            sid = server.lifecycle.create(server.new_segments()).id
            async with client_of(app) as http:
                listing = await http.get(f"/sessions/{sid}/v1/models")
                assert listing.status_code == 200 and listing.content == engine.models_reply.body
                engine.models_reply = EngineReply(503, b"engine warming up", "text/plain")
                down = await http.get(f"/sessions/{sid}/v1/models")
                assert (down.status_code, down.text) == (503, "engine warming up")
                assert down.headers["content-type"].startswith("text/plain")
                engine.calls.clear()
                assert (await http.get("/sessions/nope/v1/models")).status_code == 404
                assert engine.calls == []  # an unknown session never reaches the engine

    asyncio.run(main())


def test_one_model_is_looked_up_in_the_list_never_forwarded(family: ModelFamily) -> None:
    async def main() -> None:
        engine = StubEngine()
        with in_process_app(family, engine=engine) as (app, server):
            sid = server.lifecycle.create(server.new_segments()).id
            base = f"/sessions/{sid}/v1/models/"
            async with client_of(app) as http:
                found = await http.get(base + "org/other")  # an id with a slash
                missing = await http.get(base + "gpt-4")
                escape = await http.get(base + "..%2Fabort_request")
                engine.models_reply = EngineReply(200, b'{"data": 5}', "application/json")
                malformed = await http.get(base + "qwen/tiny")
                engine.models_reply = EngineReply(401, b'{"error": "key"}', "application/json")
                refused = await http.get(base + "qwen/tiny")
            assert found.status_code == 200 and found.json() == {"id": "org/other", "object": "model"}
            assert missing.status_code == 404
            assert missing.json()["error"] == {"message": "The model 'gpt-4' does not exist",
                                               "type": "invalid_request_error", "param": "model",
                                               "code": "model_not_found"}
            assert escape.status_code == 404 and escape.json()["error"]["code"] == "model_not_found"
            assert malformed.status_code == 502 and "malformed" in malformed.text
            assert (refused.status_code, refused.content) == (401, b'{"error": "key"}')
            assert set(engine.calls) == {"models"}  # only the read-only list is ever asked for

    asyncio.run(main())
