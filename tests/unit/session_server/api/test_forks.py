"""session_server.api.forks over the real app in process: a fork's children hold the parent's history and lineage,
replica-named ids, and every refusal (busy, unknown, a bad n or point, a full server, a journal that cannot write)
leaves nothing behind."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from session_server.sessions.journal import JournalUnavailableError, SessionInfo
from session_server.sessions.session import Session
from support.bounded import user
from support.inprocess_app import client_of, in_process_app
from support.tito import Reply, generate
from trajectory import ModelFamily


def turn(session: Session, request: list[dict[str, Any]], text: str) -> None:
    segments = session.segments
    plan = segments.reserve(segments.prepare(request, busy=session.busy_segments()))
    segments.commit(plan, *generate(segments.main.family, plan.turn, Reply(text), rid=f"rid-{text}"))


def played(server: Any, turns: int = 2) -> Session:
    session = server.registry.create(server.new_segments(), {"task": "t", "seed": 1})
    history: list[dict[str, Any]] = []
    for i in range(turns):
        history = [*session.trajectory.messages, user(f"step {i}")]
        turn(session, history, f"reply {i}")
    return session


class FailingJournal:
    def __init__(self) -> None:
        self.forks = 0

    async def forked(self, parent_id: str, segment: int, version: int, children: list[SessionInfo],
                     prime: tuple[str, bytes] | None = None) -> None:
        self.forks += 1
        raise JournalUnavailableError("journal write failed")


def test_children_hold_the_parents_history_under_its_replica_name(family: ModelFamily) -> None:
    async def main() -> None:
        with in_process_app(family, replica_name="r1") as (app, server):
            parent = played(server)
            async with client_of(app) as http:
                reply = await http.post(f"/sessions/{parent.id}/fork", json={"n": 3, "at": 1,
                                                                             "metadata": {"seed": 2}})
            assert reply.status_code == 200, reply.text
            body = reply.json()
            assert body["fork_turns"] == 1 and body["fork_position"] == parent.trajectory.checkpoints[0].num_tokens
            ids = body["session_ids"]
            assert len(set(ids)) == 3 and all(re.fullmatch(r"r1\.[0-9a-f]{32}", i) for i in ids)
            for sid in ids:
                child = server.registry.require(sid)
                assert child.metadata == {"task": "t", "seed": 2}
                prefix = parent.trajectory.token_ids[:body["fork_position"]]
                assert child.trajectory.token_ids.tolist() == prefix.tolist()
                assert child.trajectory.messages == parent.trajectory.messages[:2]
                assert child.lineage is not None and child.lineage.info() == {
                    "parent_session": parent.id, "fork_segment": 0, "fork_turns": 1,
                    "fork_position": body["fork_position"], "group": body["group"], "root_session": parent.id,
                    "depth": 1}
            assert len(server.registry) == 4

    asyncio.run(main())


def test_refusals_leave_nothing_behind(family: ModelFamily) -> None:
    async def main() -> None:
        with in_process_app(family, max_fork=3, max_sessions=4, retry_after=4) as (app, server):
            parent = played(server)
            async with client_of(app) as http:
                claim = server.lifecycle.claim(parent.id)  # a chat in flight
                busy = await http.post(f"/sessions/{parent.id}/fork", json={"n": 1})
                claim.release()
                too_many = await http.post(f"/sessions/{parent.id}/fork", json={"n": 4})
                bad_at = await http.post(f"/sessions/{parent.id}/fork", json={"n": 1, "at": 3})
                bad_meta = await http.post(f"/sessions/{parent.id}/fork", json={"n": 1, "metadata": [1]})
                unknown = await http.post("/sessions/nope/fork", json={"n": 1})
                server.registry.create(server.new_segments())
                server.registry.create(server.new_segments())
                full = await http.post(f"/sessions/{parent.id}/fork", json={"n": 2})  # 3 + 2 > 4
            assert busy.status_code == 409
            assert too_many.status_code == 400 and "--max-fork" in too_many.text
            assert bad_at.status_code == 400 and bad_at.json()["error"]["type"] == "invalid_fork_point"
            assert bad_meta.status_code == 400 and unknown.status_code == 404
            # 429, not POST /sessions' 503: the server is up, the fork asked for more room than it has now
            assert full is not None and full.status_code == 429 and full.headers["retry-after"] == "4"
            assert full.json()["error"]["type"] == "too_many_sessions"
            assert len(server.registry) == 3  # the parent and the two made by hand: no child of any refused fork
        journal = FailingJournal()
        with in_process_app(family, journal=journal) as (app, server):
            parent = played(server)
            async with client_of(app) as http:
                refused = await http.post(f"/sessions/{parent.id}/fork", json={"n": 2})
            assert refused.status_code == 503 and journal.forks == 1
            assert len(server.registry) == 1  # no id handed out without the children on disk

    asyncio.run(main())


def test_a_group_in_one_request_is_all_or_nothing(family: ModelFamily) -> None:
    """POST /sessions with `prime` and `n` (the engine's prefill off here: no engine): n sessions at the primed
    prompt, their root never registered and never counted on a worker; past --max-sessions a 429 and nothing made,
    as a fork; a journal that cannot write them: 503, no id handed out."""
    prime = {"messages": [{"role": "user", "content": "the group's task"}]}

    async def main() -> None:
        with in_process_app(family, max_sessions=4, retry_after=4, fork_prefill="off") as (app, server):
            async with client_of(app) as http:
                made = await http.post("/sessions", json={"prime": prime, "n": 3, "metadata": {"k": 1}})
                full = await http.post("/sessions", json={"prime": prime, "n": 2})  # 3 + 2 > 4
            assert made.status_code == 200, made.text
            body = made.json()
            assert len(body["session_ids"]) == 3 and body["fork_turns"] == 0
            assert body["fork_position"] == body["prompt_tokens"] > 0 and body["prefill"] is None
            assert not server.registry.knows(body["root_session"])
            for sid in body["session_ids"]:
                child = server.registry.require(sid)
                assert child.metadata == {"k": 1} and child.trajectory.primed is not None
                assert child.lineage is not None and child.lineage.root == body["root_session"]
            assert full.status_code == 429 and full.headers["retry-after"] == "4" and len(server.registry) == 3
            assert server.engine.calls.count("forget") == 2  # each root let go of its placement, made or refused
        journal = FailingJournal()
        with in_process_app(family, journal=journal, fork_prefill="off") as (app, server):
            async with client_of(app) as http:
                refused = await http.post("/sessions", json={"prime": prime, "n": 2})
            assert refused.status_code == 503 and journal.forks == 1 and len(server.registry) == 0

    asyncio.run(main())


def test_children_ask_for_sampling_masks_as_their_parent_does(family: ModelFamily) -> None:
    """A parent opened with `return_sampling_masks` on a server that asks for none by default: its children's turns
    ask for masks too (their stored heads hold the parent's rows, their own turns must add theirs), and say so; a
    parent that asked for none has children that ask for none."""
    async def main() -> None:
        with in_process_app(family) as (app, server):
            async with client_of(app) as http:
                answers = {}
                for wanted in (True, False):
                    made = await http.post("/sessions", json={"return_sampling_masks": wanted})
                    parent = server.registry.require(made.json()["session_id"])
                    turn(parent, [user("step 0")], "reply 0")
                    forked = await http.post(f"/sessions/{parent.id}/fork", json={"n": 2})
                    assert forked.status_code == 200, forked.text
                    answers[wanted] = [(await http.get(f"/sessions/{sid}")).json()["return_sampling_masks"]
                                       for sid in forked.json()["session_ids"]]
                    assert all(server.registry.require(sid).sampling_masks is wanted
                               for sid in forked.json()["session_ids"])
            assert answers == {True: [True, True], False: [False, False]}

    asyncio.run(main())
