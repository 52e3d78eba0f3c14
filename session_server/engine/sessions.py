"""SGLang streaming sessions (--engine-sessions): one per trajectory, so each turn prefills only its new tokens.

A streaming engine session is append-only (DESIGN.md 5.2): it can only be reused when it holds exactly the prefix the
next prompt keeps (`plan.new_token_start`). Anything else -- a rollback, a trimmed stop token, or an uncommitted turn
that ran in it (502, abort, disconnect) -- replaces it with a fresh one that receives the full prompt. The trajectory's
tokens are therefore identical with and without the flag; only the engine's prefill work differs.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from typing import Any

from session_server.engine.placement import EnginePool
from session_server.errors import EngineUnavailableError
from session_server.sessions.registry import Session

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


class EngineSessions:
    def __init__(self, engine: EnginePool, idle_timeout: float = 0.0) -> None:
        self._engine = engine
        self._orphans: set[asyncio.Task[None]] = set()
        self.engine_timeout = (idle_timeout + ENGINE_TIMEOUT_MARGIN if idle_timeout > 0
                               else NO_IDLE_TIMEOUT_ENGINE_TIMEOUT)

    async def begin_turn(self, session: Session, new_token_start: int) -> tuple[int, dict[str, Any]]:
        """Return (first prompt index to send, session_params), opening or replacing the engine session as needed."""
        st = session.engine
        if st.sid is not None and not st.dirty and st.tokens > 0 and st.tokens == new_token_start:
            return new_token_start, {"id": st.sid}
        if st.sid is not None:
            await self.close(session)
        sid = f"{session.id}-{secrets.token_hex(4)}"
        try:
            st.sid = await self._engine.open_session(CAPACITY_OF_STR_LEN, session.id, self.engine_timeout, sid)
        except EngineUnavailableError:
            # A timed-out open may still be carried out once the engine moves again: close that id later.
            self._close_orphan(sid, session.id)
            raise
        st.tokens = 0
        st.dirty = False
        return 0, {"id": st.sid}

    @staticmethod
    def committed(session: Session, total_tokens: int) -> None:
        session.engine.tokens = total_tokens
        session.engine.dirty = False

    def _close_orphan(self, sid: str, routing_key: str) -> None:
        task = asyncio.get_running_loop().create_task(self._orphan_closer(sid, routing_key))
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

    @staticmethod
    def forget(session: Session) -> None:
        """The engine no longer holds the session (restart, its idle timeout): drop it without a close call, so the
        next begin_turn opens a fresh one and sends the whole prompt."""
        session.engine.reset()

    @staticmethod
    def mark_dirty(session: Session) -> None:
        session.engine.dirty = True

    async def close(self, session: Session) -> None:
        """Close the engine session, if any. Called by DELETE/shutdown only after the in-flight chat has finished."""
        sid = session.engine.reset()
        if sid is not None and not await self._engine.close_session(sid, session.id):
            logger.warning("session %s: engine session %s may not be closed", session.id, sid)
