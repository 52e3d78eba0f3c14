"""session_server.sessions.sweeper: lost episodes are deleted after --session-idle-timeout, through DELETE's path.

Idleness is read from the clocks the code keeps (`last_active`, a claim's `started`), set by the tests, so no verdict
depends on how fast the machine is: a session is idle past the timeout, a chat is stuck past the request timeout, a
pause expires nothing. The background task is run for real on a loop, with every wait bounded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from session_server.errors import AbortReason, SessionNotFoundError
from session_server.metrics import Metrics
from session_server.sessions.lifecycle import Lifecycle
from session_server.sessions.registry import Registry
from session_server.sessions.session import Session
from session_server.sessions.sweeper import Sweeper, idle_sessions, sweep_interval
from support.bounded import BOUND
from trajectory import LinearTrajectory, ModelFamily, SegmentSet


def lifecycle() -> tuple[Lifecycle, Metrics]:
    metrics = Metrics()
    return Lifecycle(Registry(), retry_after=1, metrics=metrics), metrics


def new(lc: Lifecycle, family: ModelFamily, idle_for: float = 0.0) -> Session:
    session = lc.create(SegmentSet(lambda: LinearTrajectory(family)))
    session.last_active = time.monotonic() - idle_for
    return session


def expired(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("session_server_sessions_expired_total") or 0.0


@pytest.mark.parametrize(("timeout", "interval"), [(0.1, 0.05), (1.0, 0.1), (30.0, 3.0), (3600.0, 5.0)])
def test_a_tenth_of_the_timeout_between_50_ms_and_5_s(timeout: float, interval: float) -> None:
    assert sweep_interval(timeout) == pytest.approx(interval)


def test_idle_means_unused_past_the_timeout_with_no_chat_younger_than_the_request_timeout(family: ModelFamily) -> None:
    lc, _ = lifecycle()
    now = 1000.0
    fresh, edge, idle, closing, chatting, stuck = (new(lc, family) for _ in range(6))
    lc.claim(chatting.id).started = now - 60  # exactly the request timeout: still a live chat
    lc.claim(stuck.id).started = now - 61
    fresh.last_active = now - 5
    edge.last_active = now - 10  # exactly the timeout: not yet
    for s in (idle, closing, chatting, stuck):
        s.last_active = now - 11
    closing.closing = True  # already on its way out
    assert idle_sessions(lc.registry.sessions(), now, idle_timeout=10, request_timeout=60) == [idle, stuck]


def test_a_sweep_expires_idle_sessions_through_deletes_path(family: ModelFamily) -> None:
    """Marked closing at once (404 from then on), the stuck chat aborted and waited for, a tombstone that says
    why, counted; the live session untouched."""
    async def main() -> None:
        lc, metrics = lifecycle()
        live, idle, stuck = new(lc, family), new(lc, family, idle_for=100), new(lc, family, idle_for=100)
        claim = lc.claim(stuck.id)
        claim.started -= 100
        stuck.last_active -= 100  # the claim touched it
        seen: list[Any] = []

        def on_abort() -> None:  # the stuck handler sees the session closing, then lets go
            seen.append((claim.reason, stuck.closing))
            asyncio.get_running_loop().call_soon(claim.release)

        claim.on_abort(on_abort)
        assert await asyncio.wait_for(Sweeper(lc, 10, 60).sweep_once(), BOUND) == 2
        assert seen == [(AbortReason.EXPIRY, True)]
        for s in (idle, stuck):
            with pytest.raises(SessionNotFoundError, match="expired after being idle"):
                lc.registry.require(s.id)
        assert lc.registry.require(live.id) is live and expired(metrics) == 2

    asyncio.run(main())


def test_nothing_expires_while_paused(family: ModelFamily) -> None:
    async def main() -> None:
        lc, metrics = lifecycle()
        idle = new(lc, family, idle_for=100)
        lc.pause.restore("drain")
        assert await Sweeper(lc, 10, 60).sweep_once() == 0
        assert lc.registry.get(idle.id) is idle and not idle.closing and expired(metrics) == 0

    asyncio.run(main())


class RefusingJournal:
    """A journal whose disk refuses one session's tombstone."""

    def __init__(self, refused: str) -> None:
        self.refused = refused

    async def deleted(self, session_id: str, why: str) -> None:
        if session_id == self.refused:
            raise OSError("disk full")


def test_a_failed_expiry_is_logged_and_the_others_still_go(
    family: ModelFamily, caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        lc, _ = lifecycle()
        broken, fine = new(lc, family, idle_for=100), new(lc, family, idle_for=100)
        lc.journal = RefusingJournal(broken.id)  # type: ignore[assignment]
        assert await asyncio.wait_for(Sweeper(lc, 10, 60).sweep_once(), BOUND) == 2
        assert lc.registry.get(fine.id) is None and lc.registry.is_tombstoned(fine.id)
        assert lc.registry.get(broken.id) is broken and not broken.closing  # still there: the next sweep retries

    with caplog.at_level(logging.ERROR, logger="session_server.sessions.sweeper"):
        asyncio.run(main())
    assert any("expiring it failed" in r.getMessage() and "disk full" in r.getMessage() for r in caplog.records)


def test_the_background_sweep_expires_outlives_failures_and_stops(family: ModelFamily) -> None:
    async def main() -> None:
        lc, _ = lifecycle()
        sweeper = Sweeper(lc, idle_timeout=0.2, request_timeout=60)  # scans every 50 ms
        real, calls, gone = sweeper.sweep_once, [], asyncio.Event()

        async def flaky() -> int:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("one bad scan")
            n = await real()
            if lc.registry.get(idle.id) is None:
                gone.set()
            return n

        sweeper.sweep_once = flaky  # type: ignore[method-assign]
        idle = new(lc, family, idle_for=100)
        sweeper.start()
        await asyncio.wait_for(gone.wait(), BOUND)
        assert len(calls) >= 2  # the failing scan did not end the task
        await asyncio.wait_for(sweeper.stop(), BOUND)
        assert sweeper._task is not None and sweeper._task.done()

    asyncio.run(main())


def test_stop_lets_an_expiry_in_progress_finish(family: ModelFamily) -> None:
    """Stopping while a stuck chat's handler is still letting go does not cut the deletion off half-done."""
    async def main() -> None:
        lc, _ = lifecycle()
        sweeper = Sweeper(lc, idle_timeout=0.2, request_timeout=1)
        stuck = new(lc, family)
        claim = lc.claim(stuck.id)
        claim.started -= 100
        stuck.last_active -= 100
        aborted, let_go = asyncio.Event(), asyncio.Event()
        claim.on_abort(aborted.set)

        async def handler() -> None:
            await aborted.wait()
            await let_go.wait()
            claim.release()

        owner = asyncio.create_task(handler())
        sweeper.start()
        await asyncio.wait_for(aborted.wait(), BOUND)
        stopping = asyncio.create_task(sweeper.stop())
        await asyncio.sleep(0.01)
        assert not stopping.done()  # it waits for the deletion in progress
        let_go.set()
        await asyncio.wait_for(stopping, BOUND)
        await owner
        assert lc.registry.is_tombstoned(stuck.id)

    asyncio.run(main())


def test_no_timeout_no_sweep(family: ModelFamily) -> None:
    async def main() -> None:
        lc, _ = lifecycle()
        sweeper = Sweeper(lc, idle_timeout=0, request_timeout=60)
        sweeper.start()
        assert sweeper._task is None
        await asyncio.wait_for(sweeper.stop(), BOUND)

    asyncio.run(main())
