"""Committing a turn: the one place a chat (plain or streamed) changes a trajectory.

Without a journal: `SegmentSet.commit` (the turn's segment; a new segment is added with its first turn) under the
session lock. With `--journal`: stage the commit (validated,
nothing mutated), write it to the journal, then apply it -- the reply is sent only for a turn that is on disk. The
apply runs in the write's done-callback, so a handler cancelled while it waits (shutdown) still applies a turn that
reached the disk: memory never falls behind the journal. The callback is synchronous, like every other holder of
the session lock, so it cannot interleave with a reader's snapshot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

from session_server.sessions.journal import SessionInfo
from session_server.sessions.session import Session
from session_server.state import ServerState
from trajectory import GenerateResult, SegmentPlan, TurnRecord
from trajectory.errors import InvariantError

logger = logging.getLogger("session_server.turns.commit")


async def commit_turn(
    server: ServerState, session: Session, plan: SegmentPlan, result: GenerateResult, message: dict[str, Any]
) -> TurnRecord:
    """Commit (and journal, with --journal) one turn; InvariantError (500) or JournalUnavailableError (503)."""
    if server.engine_sessions is not None:  # how the turn used its engine session, on its record and in the samples
        result = dataclasses.replace(result, engine_session=server.engine_sessions.take_mode(session.id))
    segments = session.segments
    journal = server.journal
    async with session.lock:
        try:
            if journal is None:
                return segments.commit(plan, result, message)
            staged = segments.stage(plan, result, message)
        except InvariantError as err:
            logger.error("session %s: invariant broken at commit: %s", session.id, err)
            raise
        trajectory = plan.start.trajectory if plan.start is not None else segments.get(plan.segment).trajectory
        prev_messages, prev_tools = trajectory.messages, trajectory.tools

    def apply(written: asyncio.Future[None]) -> None:
        if written.cancelled() or written.exception() is not None:
            return
        try:
            segments.apply(staged)
        except InvariantError:
            logger.exception("session %s: journaled turn does not apply", session.id)

    started = time.perf_counter()
    info = None if staged.start is None else staged.start.info()
    written = journal.write_turn(SessionInfo.of(session), staged.delta, prev_messages, prev_tools, plan.segment, info)
    written.add_done_callback(apply)
    await asyncio.shield(written)
    server.metrics.stage("journal", time.perf_counter() - started)
    if trajectory.version != staged.delta.version + 1:
        raise InvariantError(f"session {session.id}: journaled turn was not applied")
    return staged.delta.record
