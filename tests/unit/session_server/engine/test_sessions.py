"""engine/sessions.py: DELETE's close (`retire`) never waits for the engine, comes after the abort it is given, is
retried when it fails, and what never closes is reported; a turn whose open failed goes without and the next tries
again; a turn with nothing to reuse opens none (the next one does); a worker holds at most its cap of engine
sessions (each keeps one of the engine's request rows), past which a turn goes without until a close frees a slot."""

from __future__ import annotations

import asyncio
from typing import Any

from session_server.engine.placement import Worker, max_running_requests
from session_server.engine.sessions import EngineSessions, engine_session_cap
from session_server.errors import EngineUnavailableError
from session_server.metrics import Metrics
from support.bounded import bounded


class FakeEngine:
    """The placement side of EngineSessions: every call logged; close and open answer when told to."""

    def __init__(self) -> None:
        self.on_move: list[Any] = []
        self.log: list[tuple[str, str]] = []
        self.close_gate = asyncio.Event()
        self.close_gate.set()
        self.close_ok = True
        self.open_ok = True
        self.open_gate = asyncio.Event()
        self.open_gate.set()
        self.open_called = asyncio.Event()
        self.worker = Worker("http://engine", None)  # type: ignore[arg-type]
        self.rows: int | None = None  # the engine's max_running_requests, as its /server_info says (None: silent)

    def worker_of(self, session_id: str) -> Worker:
        return self.worker

    async def rows_of(self, worker: Worker) -> int | None:
        return self.rows

    async def open_session(self, capacity: int, routing_key: str, idle_timeout: float | None, sid: str,
                           deadline: float | None) -> str:
        self.log.append(("open", sid))
        self.open_called.set()
        await self.open_gate.wait()
        if not self.open_ok:
            raise EngineUnavailableError("engine POST /open_session did not answer within 1s")
        return sid

    async def close_session(self, sid: str, routing_key: str) -> bool:
        self.log.append(("close", sid))
        await self.close_gate.wait()
        return self.close_ok

    async def ready(self) -> bool:
        return True

    def holders(self, routing_key: str) -> list[Worker]:
        return [self.worker]


def _count(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float:
    return metrics.registry.get_sample_value(f"session_server_{name}_total", labels or {}) or 0.0


def test_retire_returns_at_once_and_closes_after_the_abort() -> None:
    async def main() -> None:
        engine = FakeEngine()
        engine.close_gate.clear()  # the engine does not answer closes: a caller that waited would hang
        sessions = EngineSessions(engine)  # type: ignore[arg-type]
        await sessions.begin_turn("s", 80)  # a turn with history to reuse opens one
        sid = engine.log[-1][1]
        abort_landed = asyncio.Event()

        async def abort() -> None:
            engine.log.append(("abort landed", ""))
            await abort_landed.wait()

        sessions.retire("s", abort)  # synchronous: nothing here can wait for the engine
        assert sessions.state("s") is None and sessions.closes_under_way == 1
        await asyncio.sleep(0)
        assert engine.log[-1] == ("abort landed", "")  # the close waits for the abort
        abort_landed.set()
        for _ in range(3):
            await asyncio.sleep(0)
        assert engine.log[-1] == ("close", sid)  # then closes, in the background
        engine.close_gate.set()
        assert await bounded(sessions.wait_closes(10.0))
        assert sessions.closes_under_way == 0 and not sessions.unclosed

    asyncio.run(main())


def test_a_failed_close_is_retried_and_one_that_never_lands_is_reported() -> None:
    async def main() -> None:
        metrics = Metrics()
        engine = FakeEngine()
        engine.close_ok = False
        sessions = EngineSessions(engine, metrics=metrics)  # type: ignore[arg-type]
        sessions.engine_timeout = 0.3  # the retries' horizon: the engine's idle timeout closes it after that
        await sessions.begin_turn("s", 80)  # a turn with history to reuse opens one
        sid = engine.log[-1][1]
        sessions.retire("s")
        assert await bounded(sessions.wait_closes(10.0))
        closes = [entry for entry in engine.log if entry == ("close", sid)]
        assert len(closes) >= 1 and list(sessions.unclosed) == [sid]
        assert _count(metrics, "engine_sessions_unclosed") == 1
        assert engine.worker.engine_sessions == 0  # retried to the horizon: the engine's idle timeout freed its row
        await sessions.aclose()

    asyncio.run(main())


def test_a_turn_whose_open_fails_goes_without_and_the_next_turn_tries_again() -> None:
    async def main() -> None:
        metrics = Metrics()
        engine = FakeEngine()
        engine.open_ok = False
        sessions = EngineSessions(engine, metrics=metrics)  # type: ignore[arg-type]
        assert await sessions.begin_turn("s", 80) == (0, None)  # the whole prompt, no engine session
        assert _count(metrics, "engine_session_fallbacks") == 1 and sessions.state("s") is None
        assert sessions.take_mode("s") == "without" and sessions.take_mode("s") is None  # for the turn's record
        engine.open_ok = True
        start, params = await sessions.begin_turn("s", 120)
        assert start == 0 and params is not None and sessions.state("s") is not None
        assert [what for what, _ in engine.log].count("open") == 2 and sessions.take_mode("s") == "opened"
        sessions.committed("s", 150)
        assert (await sessions.begin_turn("s", 150))[0] == 150 and sessions.take_mode("s") == "reused"
        await sessions.aclose()

    asyncio.run(main())


def test_an_abort_cuts_a_pending_open_short_and_its_id_is_closed_later() -> None:
    """A DELETE while the turn's open is still unanswered: the turn does not wait for the engine's answer (its
    handler releases the slot, so the DELETE does not wait either); the id the engine may still open is closed."""
    async def main() -> None:
        engine = FakeEngine()
        engine.open_gate.clear()  # the engine does not answer the open
        sessions = EngineSessions(engine)  # type: ignore[arg-type]
        callbacks: list[Any] = []

        def on_abort(callback: Any) -> Any:
            callbacks.append(callback)
            return lambda: callbacks.remove(callback)

        turn = asyncio.ensure_future(sessions.begin_turn("s", 80, 60.0, on_abort))
        await bounded(engine.open_called.wait())
        (abort,) = callbacks
        abort()  # the claim is aborted (DELETE)
        assert await bounded(turn) == (0, None) and callbacks == [] and sessions.state("s") is None
        sid = engine.log[0][1]
        for _ in range(20):
            await asyncio.sleep(0)
            if ("close", sid) in engine.log:
                break
        assert ("close", sid) in engine.log  # the engine answers /ready: the orphaned id is closed
        await sessions.aclose()

    asyncio.run(main())


def test_a_turn_with_nothing_to_reuse_opens_none_and_the_next_turn_opens_one() -> None:
    """A trajectory's first turn (or a full render) reuses nothing: no open, no close, not a fallback; the next turn
    opens the engine session with the whole prompt and the one after it appends."""
    async def main() -> None:
        metrics = Metrics()
        engine = FakeEngine()
        sessions = EngineSessions(engine, metrics=metrics)  # type: ignore[arg-type]
        assert await sessions.begin_turn("s", 0) == (0, None)
        assert engine.log == [] and sessions.state("s") is None and sessions.take_mode("s") == "deferred"
        sessions.committed("s", 40)  # nothing to record: no engine session holds the turn
        sessions.retire("s")  # a single-turn episode's DELETE: nothing to close
        assert engine.log == [] and sessions.closes_under_way == 0
        start, params = await sessions.begin_turn("s", 40)
        assert start == 0 and params is not None and sessions.take_mode("s") == "opened"
        sid = engine.log[-1][1]
        sessions.committed("s", 90)
        assert (await sessions.begin_turn("s", 90))[0] == 90 and sessions.take_mode("s") == "reused"
        sessions.committed("s", 130)
        # A full render (nothing of the trajectory kept): the engine session is closed and none is opened.
        assert await sessions.begin_turn("s", 0) == (0, None) and sessions.take_mode("s") == "deferred"
        assert engine.log[-1] == ("close", sid) and sessions.state("s") is None
        assert _count(metrics, "engine_session_fallbacks") == 0
        await sessions.aclose()

    asyncio.run(main())


def test_the_cap_is_the_flag_else_the_rows_less_a_headroom() -> None:
    assert engine_session_cap(8, None) == 6  # a quarter of the rows left to first turns and plain requests
    assert engine_session_cap(4096, None) == 3072
    assert engine_session_cap(2, None) == 1 and engine_session_cap(1, None) == 1  # one row left; one session at least
    assert engine_session_cap(None, None) is None  # an engine that does not say: no cap
    assert engine_session_cap(8, 3) == 3 and engine_session_cap(None, 3) == 3  # the flag wins
    assert engine_session_cap(8, 0) is None  # 0: no cap


def test_rows_are_read_from_server_info_as_sglang_reports_them() -> None:
    # SGLang 0.5.23: the scheduler's value per DP rank, beside the resolved server arg (None when left to the engine)
    assert max_running_requests({"max_running_requests": None,
                                 "internal_states": [{"effective_max_running_requests_per_dp": 8}]}) == 8
    assert max_running_requests({"max_running_requests": 16, "internal_states": [{}]}) == 16
    assert max_running_requests({"max_running_requests": None}) is None
    assert max_running_requests({"max_running_requests": True}) is None


def test_past_the_cap_a_turn_goes_without_and_a_close_frees_the_slot_for_a_later_turn() -> None:
    async def main() -> None:
        engine, metrics = FakeEngine(), Metrics()
        engine.rows = 4  # cap 3
        sessions = EngineSessions(engine, metrics=metrics)  # type: ignore[arg-type]
        for name in ("a", "b", "c"):
            assert (await sessions.begin_turn(name, 80))[1] is not None
            assert sessions.take_mode(name) == "opened"
        assert engine.worker.engine_sessions == 3
        opens = len(engine.log)
        assert await sessions.begin_turn("d", 80) == (0, None)  # the whole prompt, no engine session
        assert sessions.take_mode("d") == "without" and len(engine.log) == opens  # no open sent
        assert _count(metrics, "engine_sessions_at_cap") == 1 and _count(metrics, "engine_session_fallbacks") == 1
        await sessions.begin_turn("d", 120)  # still full: without again
        assert sessions.take_mode("d") == "without" and _count(metrics, "engine_sessions_at_cap") == 2

        sessions.retire("a")  # DELETE: the slot frees once its close has landed
        await bounded(sessions.wait_closes(5.0))
        assert engine.worker.engine_sessions == 2
        assert (await sessions.begin_turn("d", 160))[1] is not None and sessions.take_mode("d") == "opened"
        assert engine.worker.engine_sessions == 3

        await sessions.close("b")  # a close of our own (a replaced engine session) frees its slot too
        sessions.forget("c")  # as does one the engine lost
        assert engine.worker.engine_sessions == 1
        engine.open_ok = False  # an open that fails holds its slot until its id is closed (it may have landed)
        await sessions.begin_turn("e", 80)
        assert sessions.take_mode("e") == "without" and engine.worker.engine_sessions == 2
        await sessions.aclose()

    asyncio.run(main())


def test_without_rows_known_or_with_the_cap_off_every_turn_opens_one() -> None:
    async def main() -> None:
        for rows, flag in ((None, None), (2, 0)):
            engine = FakeEngine()
            engine.rows = rows
            sessions = EngineSessions(engine, max_per_engine=flag)  # type: ignore[arg-type]
            for i in range(5):
                await sessions.begin_turn(f"s{i}", 80)
                assert sessions.take_mode(f"s{i}") == "opened"
            assert engine.worker.engine_sessions == 5
            await sessions.aclose()

    asyncio.run(main())


def test_a_close_that_never_lands_keeps_its_slot_until_the_engines_idle_timeout_frees_the_row() -> None:
    """Too many closes already being retried: this one is given up at once, but the engine still keeps the session's
    request row until its own idle timeout, so the slot stays taken (a turn past the cap goes without) until then."""
    async def main() -> None:
        for idle_timeout in (3600.0, 0.05):
            engine, metrics = FakeEngine(), Metrics()
            engine.rows, engine.close_ok = 2, False  # cap 1; the engine refuses every close
            sessions = EngineSessions(engine, metrics=metrics, max_close_retries=0)  # type: ignore[arg-type]
            sessions.engine_timeout = idle_timeout
            await sessions.begin_turn("a", 80)
            sid = engine.log[-1][1]
            sessions.retire("a")
            await bounded(sessions.wait_closes(5.0))
            assert list(sessions.unclosed) == [sid] and _count(metrics, "engine_sessions_unclosed") == 1
            if idle_timeout > 60:
                assert engine.worker.engine_sessions == 1  # the row is still the engine's
                assert await sessions.begin_turn("b", 80) == (0, None) and sessions.take_mode("b") == "without"
            else:  # once the engine's idle timeout has passed, the slot is free
                for _ in range(1000):
                    if engine.worker.engine_sessions == 0:
                        break
                    await asyncio.sleep(0.01)
                assert engine.worker.engine_sessions == 0
                assert (await sessions.begin_turn("b", 80))[1] is not None and sessions.take_mode("b") == "opened"
            await sessions.aclose()

    asyncio.run(main())


def test_engine_sessions_a_killed_predecessor_left_take_slots_until_their_close_lands() -> None:
    async def main() -> None:
        engine = FakeEngine()
        engine.rows = 2  # cap 1
        engine.close_gate.clear()  # the engine has not answered the closes yet
        sessions = EngineSessions(engine)  # type: ignore[arg-type]
        assert sessions.close_stale([("old", "old-1a2b3c4d")]) == 1
        assert engine.worker.engine_sessions == 1
        assert await sessions.begin_turn("new", 80) == (0, None) and sessions.take_mode("new") == "without"
        engine.close_gate.set()
        assert await bounded(sessions.wait_closes(5.0))
        assert ("close", "old-1a2b3c4d") in engine.log and engine.worker.engine_sessions == 0
        assert (await sessions.begin_turn("new", 120))[1] is not None and sessions.take_mode("new") == "opened"
        await sessions.aclose()

    asyncio.run(main())
