"""SGLang streaming sessions (--engine-sessions): one per trajectory, so each turn prefills only its new tokens.

A streaming engine session is append-only (docs/design.md 5.2): it can only be reused when it holds exactly the prefix
the next prompt keeps (`plan.new_token_start`). Anything else -- a rollback, a trimmed stop token, or an uncommitted
turn that ran in it (502, abort, disconnect) -- replaces it with a fresh one that receives the full prompt. The
trajectory's tokens are therefore identical with and without the flag; only the engine's prefill work differs.

None is opened for a turn that keeps nothing of the trajectory (its first turn, a full render): the turn would send
its whole prompt into a fresh one anyway, so it goes without (mode "deferred") and leaves its KV to the engine's
radix cache; the next turn opens the engine session with its whole prompt, which the engine matches against that
cache, and the turns after it append. A GRPO step's burst of single-turn episodes thus sends no open and no close:
before, each first turn waited for an `/open_session` round trip through an engine busy with the whole burst before
its `/generate` (at 1,000 sessions on a loaded machine that pushed half the chats past a 4 s deadline).

The state of each trajectory's engine session is kept here, by session id: engine code never sees the session record.

Under load the engine answers control calls late (a burst of 300 new sessions on a slow machine: many `/open_session`
calls took over a second). An open on a turn's path therefore gets half of what the turn's deadline leaves, not the
control timeout; if it still fails, the turn is sent without an engine session (the whole prompt, as without
--engine-sessions), counted, never a 502 for a missing optimisation. A close that fails (the engine busy, or down for a
moment) is retried in the background with backoff (engine/retries.py, the same machinery as failed aborts) until it
lands or the engine session's own idle timeout (sent with the open) has closed it anyway; at most MAX_CLOSE_RETRIES run
at once, beyond which the idle timeout is left to do it. Both are counted in /metrics.

DELETE never waits for the engine (`retire`): the session's engine session is forgotten at once and closed in the
background, after the abort of what ran in it has landed (bounded by the caller's wait), with the same bounded retries.
An engine session whose close never landed (the retries' horizon passed, too many were being retried, an orphaned
open's engine never answered, a moved session's old worker refused) is kept in a short list of UNCLOSED_KEPT ids and
counted (`engine_sessions_unclosed_total`; `GET /admin/sessions` shows both), and its KV is then the engine's idle
timeout's to free. A shutdown waits for the closes under way, bounded (`wait_closes`).

Each open engine session keeps one of the engine's request rows until it is closed (SGLang 0.5.23: a streaming
session's slot keeps its first turn's `req_to_token_pool` row; the engine has `--max-running-requests` of them and
admits a request only into a free row; docs/engines.md). With as many open as the engine has rows, every other
request waits forever. So at most `cap` engine sessions are open on a worker at once (ids whose open was sent and
whose close has not landed or been given up, counted per worker): --max-engine-sessions-per-engine, by default the
worker's rows (its /server_info) less ROW_HEADROOM of them, so first turns and plain requests still run. A turn that
would open one past the cap goes without (mode "without", counted); a later turn tries again, and a close (a DELETE,
a replaced or moved one) frees its slot. A slot is freed only when the engine has let the row go: an engine session
whose close never landed keeps its slot until the engine's idle timeout has closed it (`_unclosed`), and the ones a
killed predecessor left (`close_stale`) hold a slot on every worker that may have them until their close lands.

A server killed outright (SIGKILL, OOM) cannot close its engine sessions, and their KV would stay until the engine's
idle timeout (the request timeout plus a minute at least). So every engine session id is put in a book before its
open is sent (`on_opening`; with --journal, the journal's engine_sessions table) and taken out once it is closed or
moot (`on_gone`); a server restarted on the journal closes whatever its predecessor left there (`close_stale`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from session_server.engine.client import Answer
from session_server.engine.placement import EnginePlacement, Worker
from session_server.engine.retries import ControlRetries
from session_server.errors import EngineUnavailableError
from session_server.metrics import Metrics

logger = logging.getLogger("session_server.engine.sessions")

CAPACITY_OF_STR_LEN = 1 << 20
# The engine session's own idle timeout (OpenSessionReqInput.timeout) is ours plus this margin: long enough that the
# engine never closes a session we still use between two turns, short enough that a crashed session server's
# engine sessions (and their KV) do not outlive it by much. Without any idle timeout of ours, a day. Never shorter
# than the longest turn (--request-timeout) plus the margin: SGLang 0.5.23 counts a session's idleness from the start
# of its last request (session_controller.py `last_active_time`), and a streaming session that times out while its
# request runs kills the scheduler (an assertion in release_kv_cache when the request ends; seen on the real engine).
ENGINE_TIMEOUT_MARGIN = 60.0
ORPHAN_WAIT = 60.0
NO_IDLE_TIMEOUT_ENGINE_TIMEOUT = 24 * 3600.0
OPEN_SHARE = 0.5  # of the turn's remaining deadline an open on its path may take; the rest is for the turn itself
CLOSE_BACKOFF = (0.5, 30.0)  # first and largest pause between retries of a failed close (doubling)
MAX_CLOSE_RETRIES = 10_000  # failed closes retried at once (a task each); beyond, the engine's idle timeout closes
ROW_HEADROOM = 0.25  # of a worker's rows left to requests outside engine sessions (at least one row)
UNCLOSED_KEPT = 100  # the latest engine session ids whose close never landed, for /admin/sessions

# SGLang's 400 messages for a session the engine does not hold (scheduler.py handle_generate_request): after an
# engine restart, or once the engine's own idle timeout closed it.
_GONE = (b"does not exist", b"close was requested for session")


def engine_session_cap(rows: int | None, configured: int | None) -> int | None:
    """How many engine sessions may be open on a worker with `rows` request rows (None: unknown): `configured` (the
    flag; 0 = no cap), else the rows less ROW_HEADROOM of them (at least one row left, at least one session); None
    means no cap."""
    if configured is not None:
        return configured or None
    if rows is None:
        return None
    return max(1, rows - max(1, int(rows * ROW_HEADROOM)))


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
    def __init__(
        self, engine: EnginePlacement, idle_timeout: float = 0.0, metrics: Metrics | None = None,
        request_timeout: float = 0.0, on_opening: Callable[[str, str], None] | None = None,
        on_gone: Callable[[str], None] | None = None, max_per_engine: int | None = None,
        max_close_retries: int = MAX_CLOSE_RETRIES,
    ) -> None:
        self._engine = engine
        # The book of engine session ids that may be open (see the module docstring): (session id, engine sid) in,
        # engine sid out.
        self._on_opening = on_opening or (lambda _session_id, _sid: None)
        self._on_gone = on_gone or (lambda _sid: None)
        self._max_per_engine = max_per_engine  # --max-engine-sessions-per-engine (None: from the rows; 0: no cap)
        # engine sid -> the workers whose row it may hold (open sent, not yet gone; one, but every worker for an id a
        # predecessor left unplaced)
        self._slots: dict[str, tuple[Worker, ...]] = {}
        self._releases: dict[str, asyncio.TimerHandle] = {}  # unclosed ids: when the engine's idle timeout frees them
        self._metrics = metrics or Metrics()
        self._states: dict[str, EngineSessionState] = {}  # by session id: the sessions that hold one now
        self._modes: dict[str, str] = {}  # by session id: how its turn in flight uses an engine session
        self._orphans: set[asyncio.Task[Any]] = set()
        self._retiring: set[asyncio.Task[None]] = set()  # DELETE's closes under way (their first attempt)
        self.unclosed: deque[str] = deque(maxlen=UNCLOSED_KEPT)  # the latest ids whose close never landed
        self._closing = ControlRetries(self._metrics.engine_close_retries, "closed", backoff=CLOSE_BACKOFF,
                                       limit=max_close_retries)
        self.engine_timeout = (max(idle_timeout, request_timeout) + ENGINE_TIMEOUT_MARGIN if idle_timeout > 0
                               else NO_IDLE_TIMEOUT_ENGINE_TIMEOUT)
        engine.on_move.append(self._moved)

    def state(self, session_id: str) -> EngineSessionState | None:
        return self._states.get(session_id)

    async def begin_turn(
        self, session_id: str, new_token_start: int, remaining: float | None = None,
        on_abort: Callable[[Callable[[], object]], Callable[[], None]] | None = None,
    ) -> tuple[int, dict[str, Any] | None]:
        """Return (first prompt index to send, session_params), opening or replacing the engine session as needed.

        `remaining`: seconds left of the turn's deadline; an open may take OPEN_SHARE of it. An open that fails
        gives (0, None): the whole prompt, no engine session (counted). `on_abort` (the claim's): an abort of the
        turn (a DELETE) cuts a pending open short, so nothing waits for the engine's answer; the turn then raises its
        abort, and the id, which the engine may still open, is closed later."""
        st = self._states.get(session_id)
        if st is not None and not st.dirty and st.tokens > 0 and st.tokens == new_token_start:
            self._modes[session_id] = "reused"
            return new_token_start, {"id": st.sid}
        if st is not None:
            await self.close(session_id)  # first: its KV is freed before the new one fills (a failed close retries)
        if new_token_start == 0:
            # Nothing of the trajectory is reused (its first turn, a full render): an engine session would save this
            # turn nothing, so none is opened; its KV stays in the engine's radix cache, where the next turn's open
            # finds it. A single-turn episode (a GRPO step) thus costs the engine no open and no close.
            self._modes[session_id] = "deferred"
            return 0, None
        worker = self._engine.worker_of(session_id)
        cap = engine_session_cap(await self._engine.rows_of(worker), self._max_per_engine)
        if cap is not None and worker.engine_sessions >= cap:
            # Another would leave the engine too few rows for its other requests: this turn goes without.
            self._metrics.engine_sessions_at_cap.inc()
            self._metrics.engine_session_fallbacks.inc()
            self._modes[session_id] = "without"  # the next turn tries again
            return 0, None
        sid = f"{session_id}-{secrets.token_hex(4)}"
        self._hold(sid, (worker,))
        deadline = None if remaining is None else max(remaining * OPEN_SHARE, 0.001)
        self._on_opening(session_id, sid)  # before the open: a crash after it leaves the id in the book
        opening = asyncio.ensure_future(self._engine.open_session(CAPACITY_OF_STR_LEN, session_id,
                                                                  self.engine_timeout, sid, deadline))
        unsubscribe = on_abort(opening.cancel) if on_abort is not None else None
        try:
            await asyncio.wait((opening,))
        except asyncio.CancelledError:
            opening.cancel()
            self._spawn(self._orphan_closer(sid, session_id))
            raise
        finally:
            if unsubscribe is not None:
                unsubscribe()
        if opening.cancelled():  # the turn was aborted meanwhile: it commits nothing, its open may still land
            self._spawn(self._orphan_closer(sid, session_id))
            return 0, None
        try:
            opened = opening.result()
        except EngineUnavailableError as exc:
            # A timed-out open may still be carried out once the engine moves again: close that id later.
            self._spawn(self._orphan_closer(sid, session_id))
            logger.warning("session %s: no engine session (%s); the turn goes without one", session_id, exc)
            self._metrics.engine_session_fallbacks.inc()
            self._modes[session_id] = "without"  # the next turn tries to open one again
            return 0, None
        if opened != sid:  # the engine named it otherwise: its slot goes by that name
            self._slots[opened] = self._slots.pop(sid, (worker,))
        self._states[session_id] = EngineSessionState(opened)
        self._modes[session_id] = "opened"
        return 0, {"id": opened}

    def take_mode(self, session_id: str) -> str | None:
        """How the session's latest turn used an engine session (trajectory.ENGINE_SESSION_MODES), once: the commit
        records it on the turn, so a turn that went without one says so in the samples."""
        return self._modes.pop(session_id, None)

    def committed(self, session_id: str, total_tokens: int) -> None:
        st = self._states.get(session_id)
        if st is not None:
            st.tokens = total_tokens
            st.dirty = False

    def retire_all(self) -> None:
        """The engines' weights changed: every engine session holds KV of the old ones, so each is replaced by a
        fresh one on its session's next turn (engine/versions.py)."""
        for st in self._states.values():
            st.dirty = True

    def mark_dirty(self, session_id: str) -> None:
        st = self._states.get(session_id)
        if st is not None:
            st.dirty = True

    def forget(self, session_id: str) -> None:
        """The engine no longer holds the session (restart, its idle timeout): drop it without a close call, so the
        next begin_turn opens a fresh one and sends the whole prompt."""
        st = self._states.pop(session_id, None)
        if st is not None:
            self._gone(st.sid)

    async def close(self, session_id: str) -> None:
        """Close the engine session, if any. Called by DELETE/shutdown only after the in-flight chat has finished.
        A close that fails is retried in the background until it lands or the engine's idle timeout (from its last
        use, which was before the first failed close) has closed it anyway."""
        st = self._states.pop(session_id, None)
        if st is not None:
            await self._close_sid(st.sid, session_id)

    def retire(self, session_id: str, first: Callable[[], Awaitable[Any]] | None = None) -> None:
        """DELETE's close: the engine session is forgotten now and closed in the background, once `first` (the wait
        for the abort of what ran in it: an engine defers a close behind a running request) has returned; retried
        like any failed close. The caller never waits for the engine."""
        self._modes.pop(session_id, None)
        st = self._states.pop(session_id, None)
        if st is None:
            return
        task = asyncio.get_running_loop().create_task(self._close_after(st.sid, session_id, first),
                                                      name=f"close-{st.sid}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _close_after(self, sid: str, routing_key: str, first: Callable[[], Awaitable[Any]] | None) -> None:
        if first is not None:
            await first()
        await self._close_sid(sid, routing_key)

    async def _close_sid(self, sid: str, routing_key: str) -> None:
        if await self._engine.close_session(sid, routing_key):
            self._gone(sid)
        elif not self._closing.start(self._retry_close(sid, routing_key)):
            logger.warning("engine session %s not closed; %d closes are already being retried: the engine's idle "
                           "timeout will close it", sid, self._closing.pending)
            self._unclosed(sid, self.engine_timeout)

    async def _retry_close(self, sid: str, routing_key: str) -> None:
        async def attempt() -> Answer:
            return Answer.DONE if await self._engine.close_session(sid, routing_key) else Answer.RETRY

        if not await self._closing.until_landed(attempt, horizon=self.engine_timeout):
            logger.warning("engine session %s: close failed until its idle timeout closes it", sid)
            self._unclosed(sid, 0.0)  # the retries ran to the horizon: the engine's idle timeout has freed it
        else:
            self._gone(sid)

    def _gone(self, sid: str) -> None:
        """The engine session is closed or given up: out of the book, and its worker's slot is free."""
        self._on_gone(sid)
        self._free(sid)

    def _hold(self, sid: str, workers: tuple[Worker, ...]) -> None:
        """The engine session may now keep a request row on each of `workers`: one slot there until it is gone."""
        if sid in self._slots:
            return
        self._slots[sid] = workers
        for worker in workers:
            worker.engine_sessions += 1

    def _free(self, sid: str) -> None:
        release = self._releases.pop(sid, None)
        if release is not None:
            release.cancel()
        for worker in self._slots.pop(sid, ()):
            worker.engine_sessions -= 1

    def _unclosed(self, sid: str, held_for: float) -> None:
        """A close that never landed: reported (metrics, /admin/sessions). The engine's idle timeout frees it at most
        `held_for` s from now; until then its slot stays taken (the engine still keeps its row), then it is gone."""
        self.unclosed.append(sid)
        self._metrics.engine_sessions_unclosed.inc()
        if held_for <= 0 or sid not in self._slots:
            self._gone(sid)
        elif sid not in self._releases:
            self._releases[sid] = asyncio.get_running_loop().call_later(held_for, self._gone, sid)

    @property
    def closes_under_way(self) -> int:
        """DELETE's closes not yet answered, and failed closes still being retried."""
        return len(self._retiring) + self._closing.pending

    async def wait_closes(self, within: float) -> bool:
        """Shutdown: wait (at most `within` s) for DELETE's closes under way and the retried ones; True when all
        ended."""
        deadline = time.monotonic() + within
        retiring = list(self._retiring)
        if retiring and within > 0:
            await asyncio.wait(retiring, timeout=within)
        return all(t.done() for t in retiring) and await self._closing.wait(deadline - time.monotonic())

    def close_stale(self, stale: Iterable[tuple[str, str]]) -> int:
        """Close the engine sessions (session id, engine sid) a previous server process left in the book, on every
        worker that may hold them (their placement died with it), retried like any failed close; returns how many
        closes were started."""
        started = 0
        for session_id, sid in stale:
            self._hold(sid, tuple(self._engine.holders(session_id)))  # its row is taken until the close lands
            if self._closing.start(self._close_stale(sid, session_id)):
                started += 1
            else:
                self._unclosed(sid, self.engine_timeout)
        return started

    async def _close_stale(self, sid: str, routing_key: str) -> None:
        if await self._engine.close_session(sid, routing_key):
            self._gone(sid)
        else:
            await self._retry_close(sid, routing_key)

    @property
    def closes_pending(self) -> int:
        """Failed closes still being retried."""
        return self._closing.pending

    def _moved(self, session_id: str, old: Worker) -> None:
        """The session left `old` (placement.py), where its engine session lived: close it there, best effort (a
        worker that was only slow must not keep the KV); the next turn opens a fresh one on the new worker."""
        st = self._states.pop(session_id, None)
        if st is not None:
            self._spawn(self._close_on(old, st.sid, session_id))

    async def _close_on(self, worker: Worker, sid: str, routing_key: str) -> None:
        if await worker.client.close_session(sid, routing_key):
            self._gone(sid)
        else:  # the old worker keeps the row until its idle timeout (its session left it for a reason: no retries)
            self._unclosed(sid, self.engine_timeout)

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
                if await self._engine.close_session(sid, routing_key):
                    self._gone(sid)
                else:
                    await self._retry_close(sid, routing_key)
                return
            await asyncio.sleep(0.5)
        logger.warning("engine session %s may be open; the engine's idle timeout will close it", sid)
        self._unclosed(sid, self.engine_timeout - ORPHAN_WAIT)

    async def aclose(self) -> None:
        for release in self._releases.values():
            release.cancel()
        self._releases.clear()
        for task in [*self._orphans, *self._retiring]:
            task.cancel()
        await self._closing.aclose()
