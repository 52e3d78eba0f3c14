"""session_server.engine.retries in process: the one machinery behind retried closes and aborts. Real asyncio, real
prometheus counters; the attempts are scripted answers, and every wait is on an event (tiny backoffs keep it quick)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter

from session_server.engine.client import Answer
from session_server.engine.retries import ControlRetries

TINY = (0.001, 0.004)


def _retries(limit: int = 10) -> tuple[ControlRetries, Counter]:
    counter = Counter("retries", "test", ("outcome",), registry=CollectorRegistry())
    return ControlRetries(counter, "landed", backoff=TINY, limit=limit), counter


def _count(counter: Counter, outcome: str) -> float:
    return counter.labels(outcome)._value.get()


def _script(*answers: Answer) -> tuple[list[Answer], Callable[[], Awaitable[Answer]]]:
    calls: list[Answer] = []
    it: Iterator[Answer] = iter(answers)

    async def attempt() -> Answer:
        answer = next(it)
        calls.append(answer)
        return answer

    return calls, attempt


def test_retries_until_the_call_lands_counting_each_attempt() -> None:
    retries, counter = _retries()
    calls, attempt = _script(Answer.RETRY, Answer.RETRY, Answer.DONE)
    assert asyncio.run(retries.until_landed(attempt, horizon=60)) is True
    assert calls == [Answer.RETRY, Answer.RETRY, Answer.DONE]
    assert (_count(counter, "retry"), _count(counter, "landed"), _count(counter, "moot")) == (3, 1, 0)


def test_a_lasting_refusal_ends_the_retry() -> None:
    retries, counter = _retries()
    calls, attempt = _script(Answer.RETRY, Answer.REFUSED)
    assert asyncio.run(retries.until_landed(attempt, horizon=60)) is False
    assert len(calls) == 2 and _count(counter, "refused") == 1 and _count(counter, "landed") == 0


def test_a_retry_whose_object_ended_is_moot_without_another_attempt() -> None:
    retries, counter = _retries()

    async def main() -> tuple[bool, int]:
        failed = asyncio.Event()
        attempts = 0

        async def attempt() -> Answer:
            nonlocal attempts
            attempts += 1
            failed.set()
            return Answer.RETRY

        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(retries.until_landed(attempt, horizon=60, moot=ended))
        await failed.wait()  # at least one failed attempt
        ended.set_result(None)
        return await task, attempts

    landed, attempts = asyncio.run(main())
    assert landed is False
    assert _count(counter, "moot") == 1 and _count(counter, "landed") == 0
    assert _count(counter, "retry") == attempts


def test_the_horizon_bounds_the_retry() -> None:
    retries, counter = _retries()
    calls, attempt = _script(*[Answer.RETRY] * 1000)
    assert asyncio.run(retries.until_landed(attempt, horizon=0.0)) is False
    assert calls == [] and _count(counter, "moot") == 1


def test_at_most_limit_retries_run_and_the_rest_are_counted_moot() -> None:
    retries, counter = _retries(limit=2)

    async def main() -> tuple[list[bool], int]:
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def body() -> None:
            await gate

        started = [retries.start(body()) for _ in range(3)]
        pending = retries.pending
        gate.set_result(None)
        await retries.wait(60)
        return started, pending

    started, pending = asyncio.run(main())
    assert started == [True, True, False] and pending == 2
    assert retries.pending == 0 and _count(counter, "moot") == 1


def test_aclose_stops_every_retry() -> None:
    retries, _ = _retries()

    async def main() -> None:
        forever: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        assert retries.start(asyncio.wait_for(forever, None))
        assert not await retries.wait(0)
        await retries.aclose()
        assert retries.pending == 0

    asyncio.run(main())
