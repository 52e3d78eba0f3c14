"""session_server.engine.drains: an aborted engine request ends in the background, every step bounded.

The engine is a scripted stand-in for the placement's `abort` (DONE, RETRY, REFUSED, or an error), and the engine
call is a real asyncio task that ends when the "engine" ends the request or when its connection is closed
(cancelled). What is checked: which way each answer takes (wait for the engine within the grace, or close the
connection, or hand the abort to the background retry), that the next turn of a lane waits for that lane's latest
drain only, and that the waits are bounded. A grace the code must not wait out is made long (60 s) against a bound
of 10 s on the whole test step, so no verdict depends on the machine's speed. Every party lives on the loop, which
runs on a virtual clock (support/virtual_time.py): the backoffs and graces are waited exactly, in no real time.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from session_server.engine.client import Answer
from session_server.engine.drains import EngineDrains
from session_server.metrics import Metrics
from support import virtual_time
from support.bounded import BOUND, bounded

LONG = 60.0  # a grace the code must never wait out (six times BOUND)


class Engine:
    """Answers each abort from `answers` (the last one repeats); `ends_on_done`: an acknowledged abort ends the
    request (the engine's finish_reason abort), as SGLang's does."""

    def __init__(self, *answers: Answer | Exception, ends_on_done: bool = True) -> None:
        self.answers = list(answers)
        self.calls: list[tuple[str, str | None]] = []
        self.ends_on_done = ends_on_done
        self.request: asyncio.Event | None = None

    async def abort(self, rid: str, routing_key: str | None = None) -> Answer:
        self.calls.append((rid, routing_key))
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        if answer is Answer.DONE and self.ends_on_done and self.request is not None:
            self.request.set()
        return answer

    def call(self) -> asyncio.Task[str]:
        """The engine call of a running request: ends when the engine ends the request."""
        self.request = asyncio.Event()
        request = self.request

        async def generate() -> str:
            await request.wait()
            return "finish_reason abort"

        return asyncio.get_running_loop().create_task(generate())


def drains(engine: Engine, grace: float = LONG, horizon: float = 600.0) -> tuple[EngineDrains, Metrics]:
    metrics = Metrics()
    return EngineDrains(engine, metrics, grace=grace, horizon=horizon), metrics  # type: ignore[arg-type]


def count(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float:
    return metrics.registry.get_sample_value(f"session_server_{name}_total", labels or {}) or 0.0


def test_an_acknowledged_abort_lets_the_request_end_by_itself() -> None:
    async def main() -> None:
        engine = Engine(Answer.DONE)
        d, metrics = drains(engine)
        call = engine.call()
        task = d.start("s1", "rid-1", call)
        assert d.pending("s1") is task
        await bounded(task)  # ended with the request, not after the 60 s grace
        assert engine.calls == [("rid-1", "s1")]  # to the session's worker
        assert not call.cancelled() and call.result() == "finish_reason abort"
        assert d.pending("s1") is None and count(metrics, "engine_aborts") == 1

    virtual_time.run(main())


def test_a_request_that_outlives_the_grace_has_its_connection_closed() -> None:
    async def main() -> None:
        engine = Engine(Answer.DONE, ends_on_done=False)
        d, _ = drains(engine, grace=0.05)
        call = engine.call()
        await bounded(d.start("s1", "rid-1", call))
        assert call.cancelled()

    virtual_time.run(main())


def test_a_refused_abort_closes_the_connection_at_once() -> None:
    """A router's 404 will not change: no grace is waited for, nothing is retried."""
    async def main() -> None:
        engine = Engine(Answer.REFUSED)
        d, _ = drains(engine)
        call = engine.call()
        await bounded(d.start("s1", "rid-1", call))
        assert call.cancelled() and d.retries_pending == 0 and engine.calls == [("rid-1", "s1")]

    virtual_time.run(main())


def test_an_unanswered_abort_is_retried_in_the_background_holding_the_connection() -> None:
    async def main() -> None:
        engine = Engine(Answer.RETRY, Answer.RETRY, Answer.DONE)
        d, metrics = drains(engine)
        call = engine.call()
        await bounded(d.start("s1", "rid-1", call))  # the drain itself ends at once
        assert d.pending("s1") is None and d.retries_pending == 1
        assert not call.done()  # the connection stays open: its end tells when the request ended
        await bounded(d.wait_all(retries_within=BOUND))  # 0.25 s, then 0.5 s of backoff
        assert d.retries_pending == 0 and len(engine.calls) == 3
        assert call.result() == "finish_reason abort"
        assert count(metrics, "engine_abort_retries", {"outcome": "retry"}) == 2
        assert count(metrics, "engine_abort_retries", {"outcome": "aborted"}) == 1

    virtual_time.run(main())


def test_a_retry_ends_when_the_request_ends_by_itself() -> None:
    async def main() -> None:
        engine = Engine(Answer.RETRY)
        d, metrics = drains(engine)
        call = engine.call()
        await bounded(d.start("s1", "rid-1", call))
        assert engine.request is not None
        engine.request.set()  # the request finished (or the engine restarted and the connection broke)
        await bounded(d.wait_all(retries_within=BOUND))
        assert d.retries_pending == 0 and engine.calls == [("rid-1", "s1")]
        assert count(metrics, "engine_abort_retries", {"outcome": "moot"}) == 1

    virtual_time.run(main())


def test_past_the_horizon_the_connection_is_closed_unanswered() -> None:
    async def main() -> None:
        engine = Engine(Answer.RETRY)
        d, metrics = drains(engine, horizon=0.1)  # below the first backoff: no second attempt
        call = engine.call()
        await bounded(d.start("s1", "rid-1", call))
        await bounded(d.wait_all(retries_within=BOUND))
        assert call.cancelled() and len(engine.calls) == 1
        assert count(metrics, "engine_abort_retries", {"outcome": "moot"}) == 1

    virtual_time.run(main())


def test_shutdown_stops_the_retries_and_closes_their_connections() -> None:
    async def main() -> None:
        engine = Engine(Answer.RETRY)
        d, _ = drains(engine)
        call = engine.call()
        await bounded(d.start("s1", "rid-1", call))
        assert d.retries_pending == 1
        assert not await d._retries.wait(0.0)  # not waited for at all with no time given
        await bounded(d.aclose())
        assert call.cancelled() and d.retries_pending == 0

    virtual_time.run(main())


def test_an_abort_that_raises_still_closes_the_connection(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        engine = Engine(RuntimeError("client bug"))
        d, _ = drains(engine)
        call = engine.call()
        task = d.start("s1", "rid-1", call)
        with pytest.raises(RuntimeError):
            await bounded(task)
        await asyncio.sleep(0)  # the done-callback
        assert call.cancelled() and d.pending("s1") is None

    virtual_time.run(main())
    assert any("drain failed" in r.getMessage() for r in caplog.records)


def test_a_request_that_already_ended_is_not_aborted() -> None:
    async def main() -> None:
        engine = Engine(Answer.DONE)
        d, _ = drains(engine)
        call = engine.call()
        assert engine.request is not None
        engine.request.set()
        await call
        await bounded(d.start("s1", "rid-1", call))
        assert engine.calls == []

    virtual_time.run(main())


def test_the_next_turn_of_a_lane_waits_for_that_lanes_latest_drain_only() -> None:
    async def main() -> None:
        engine = Engine(Answer.DONE, ends_on_done=False)
        d, _ = drains(engine)
        first_call = engine.call()
        first = d.start("s1", "rid-1", first_call, lane="s1")
        second_call = engine.call()
        second = d.start("s1", "rid-2", second_call, lane="s1")
        other_call = engine.call()
        d.start("s1", "rid-3", other_call, lane="s1#2")  # another segment of the same session
        assert d.pending("s1") is second and engine.calls == []
        await asyncio.sleep(0)
        assert [c[0] for c in engine.calls] == ["rid-1", "rid-2", "rid-3"]
        assert all(c[1] == "s1" for c in engine.calls)  # every abort goes to the session's worker
        # The first drain ending does not clear the lane's book: the second is still what the next turn waits for.
        first_call.cancel()
        await bounded(first)
        assert d.pending("s1") is second
        assert await d.settle("s1", 0.01) is False  # bounded: the drain runs on, the turn goes on waiting no longer
        assert await d.settle("s1", 0) is False  # no time given: not waited for at all
        second_call.cancel()
        assert await bounded(d.settle("s1", LONG)) is True
        assert d.pending("s1") is None and d.pending("s1#2") is not None
        assert await d.settle("nobody", LONG) is True  # no drain: at once
        other_call.cancel()
        await bounded(d.wait_all())
        assert d.pending("s1#2") is None

    virtual_time.run(main())


def test_wait_all_waits_for_every_drain() -> None:
    async def main() -> None:
        engine = Engine(Answer.DONE, ends_on_done=False)
        d, metrics = drains(engine, grace=0.05)
        calls: list[asyncio.Task[Any]] = [engine.call() for _ in range(5)]
        tasks = [d.start(f"s{i}", f"rid-{i}", c) for i, c in enumerate(calls)]
        await bounded(d.wait_all())
        assert all(t.done() for t in tasks) and all(c.cancelled() for c in calls)
        assert count(metrics, "engine_aborts") == 5

    virtual_time.run(main())
