"""SGLang streaming sessions (--engine-sessions): one per trajectory, so each turn prefills only its new tokens.

A streaming engine session is append-only (DESIGN.md 5.2): it can only be reused when it holds exactly the prefix the
next prompt keeps (`plan.new_token_start`). Anything else -- a rollback, a trimmed stop token, or an uncommitted turn
that ran in it (502, abort, disconnect) -- replaces it with a fresh one that receives the full prompt. The trajectory's
tokens are therefore identical with and without the flag; only the engine's prefill work differs.

The state of each trajectory's engine session is kept here, by session id: engine code never sees the session record.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from session_server.engine.placement import EnginePlacement, Worker
from session_server.errors import EngineUnavailableError

logger = logging.getLogger("session_server.engine.sessions")

CAPACITY_OF_STR_LEN = 1 << 20
# The engine session's own idle timeout (OpenSessionReqInput.timeout) is ours plus this margin: long enough that the
# engine never closes a session we still use between two turns, short enough that a crashed session server's
# engine sessions (and their KV) do not outlive it by much. Without any idle timeout of ours, a day.
ENGINE_TIMEOUT_MARGIN = 60.0
ORPHAN_WAIT = 60.0
NO_IDLE_TIMEOUT_ENGINE_TIMEOUT = 24 * 3600.0

# SGLang's 400 messages for a session the engine does not hold (scheduler.py handle_generate_request): after an
# engine restart, or once the engine's own idle timeout closed it.
_GONE = (b"does not exist", b"close was requested for session")


def engine_session_gone(status: int, body: bytes) -> bool:
    """Whether an engine 400 says the streaming session named in the request is gone (reopen and resend)."""
    return status == 400 and b"session" in body and any(marker in body for marker in _GONE)


@dataclass(eq=False, slots=True)
class EngineSessionState:
    """The SGLang streaming session backing one trajectory, and what it holds."""

    sid: str
    tokens: int = 0  # number of trajectory tokens the engine session holds (valid only when not dirty)
    dirty: bool = False  # an uncommitted turn ran in it: its contents no longer match the trajectory


class EngineSessions:
    def __init__(self, engine: EnginePlacement, idle_timeout: float = 0.0) -> None:
        self._engine = engine
        self._states: dict[str, EngineSessionState] = {}  # by session id: the sessions that hold one now
        self._orphans: set[asyncio.Task[Any]] = set()
        self.engine_timeout = (idle_timeout + ENGINE_TIMEOUT_MARGIN if idle_timeout > 0
                               else NO_IDLE_TIMEOUT_ENGINE_TIMEOUT)
        engine.on_move.append(self._moved)

    def state(self, session_id: str) -> EngineSessionState | None:
        return self._states.get(session_id)

    async def begin_turn(self, session_id: str, new_token_start: int) -> tuple[int, dict[str, Any]]:
        """Return (first prompt index to send, session_params), opening or replacing the engine session as needed."""
        st = self._states.get(session_id)
        if st is not None and not st.dirty and st.tokens > 0 and st.tokens == new_token_start:
            return new_token_start, {"id": st.sid}
        if st is not None:
            await self.close(session_id)
        sid = f"{session_id}-{secrets.token_hex(4)}"
        try:
            opened = await self._engine.open_session(CAPACITY_OF_STR_LEN, session_id, self.engine_timeout, sid)
        except EngineUnavailableError:
            # A timed-out open may still be carried out once the engine moves again: close that id later.
            self._spawn(self._orphan_closer(sid, session_id))
            raise
        self._states[session_id] = EngineSessionState(opened)
        return 0, {"id": opened}

    def committed(self, session_id: str, total_tokens: int) -> None:
        st = self._states.get(session_id)
        if st is not None:
            st.tokens = total_tokens
            st.dirty = False

    def mark_dirty(self, session_id: str) -> None:
        st = self._states.get(session_id)
        if st is not None:
            st.dirty = True

    def forget(self, session_id: str) -> None:
        """The engine no longer holds the session (restart, its idle timeout): drop it without a close call, so the
        next begin_turn opens a fresh one and sends the whole prompt."""
        self._states.pop(session_id, None)

    async def close(self, session_id: str) -> None:
        """Close the engine session, if any. Called by DELETE/shutdown only after the in-flight chat has finished."""
        st = self._states.pop(session_id, None)
        if st is not None and not await self._engine.close_session(st.sid, session_id):
            logger.warning("session %s: engine session %s may not be closed", session_id, st.sid)

    def _moved(self, session_id: str, old: Worker) -> None:
        """The session left `old` (placement.py), where its engine session lived: close it there, best effort (a
        worker that was only slow must not keep the KV); the next turn opens a fresh one on the new worker."""
        st = self._states.pop(session_id, None)
        if st is not None:
            self._spawn(old.client.close_session(st.sid, session_id))

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._orphans.add(task)
        task.add_done_callback(self._orphans.discard)

    async def _orphan_closer(self, sid: str, routing_key: str) -> None:
        """Once the engine answers again (it then has read the earlier open), close the session it may have opened.
        Bounded: after ORPHAN_WAIT s the engine's own idle timeout (sent with the open) reclaims it instead."""
        deadline = time.monotonic() + ORPHAN_WAIT
        while time.monotonic() < deadline:
            if await self._engine.ready():
                await self._engine.close_session(sid, routing_key)
                return
            await asyncio.sleep(0.5)
        logger.warning("engine session %s may be open; the engine's idle timeout will close it", sid)

    async def aclose(self) -> None:
        for task in list(self._orphans):
            task.cancel()
