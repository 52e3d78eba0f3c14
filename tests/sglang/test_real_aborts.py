"""Every way a chat is cut off aborts its request in the real engine, by its rid, and leaves nothing behind.

A client that disconnects, a DELETE of the session, the server's `--request-timeout` and an admin pause in `abort`
mode each end a long generation within seconds: the server sends SGLang
`/abort_request` with the rid of its `/generate`, SGLang ends that request with an abort `finish_reason`, and its own
load report then shows no running or waiting request and no KV held by any request (`assert_engine_clean` also
flushes the radix cache, which SGLang refuses while anything holds KV). The session commits nothing.

The generation is long by construction, not by the machine's slowness: the engine runs paced (`paced`, SGLang's own
`/slow_down`) at PACE seconds per step, so LONG's 1500 tokens take at least 150 s on any machine, where every cut
here lands within a second or two of its cause; the bounds (BOUND) sit between the two, an order of magnitude from
the right answer and well short of the wrong one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from support.server import chat_url, metric, new_session
from support.sglang_engine import Served, ServeFactory, assert_engine_clean, paced, wait_loads

LONG = {"messages": [{"role": "user", "content": "Write a very long essay."}], "temperature": 0, "max_tokens": 1500}
PACE = 0.1  # seconds per engine step: LONG takes at least 150 s
BOUND = 30.0  # seconds: a cut that lands takes ~1 s (10x on a loaded machine); one that does not, LONG's 150 s
TIMEOUT = 6  # --request-timeout


@pytest.fixture(scope="module")
def served(serve: ServeFactory) -> Iterator[Served]:
    with serve("dense", "--request-timeout", str(TIMEOUT)) as s, paced(s.engine, PACE):
        yield s


async def wait_engine_running(engine: str) -> None:
    async with asyncio.timeout(120):
        await wait_loads(engine, lambda report: report["num_running_reqs"] >= 1)


def assert_aborted_by_rid(served: Served, sid: str, cause: str, before: float) -> None:
    """The one /generate of this test was aborted by its rid (and ended in SGLang with an abort finish_reason), the
    engine is idle with no KV held, the session holds no turn, and the server counted the cause."""
    calls = served.proxy.settled(timeout=30)
    (generate,) = [c for c in calls if c["path"] == "/generate"]
    aborts = [c for c in calls if c["path"] == "/abort_request"]
    assert aborts and all(c["request"]["rid"] == generate["request"]["rid"] for c in aborts), aborts
    assert all(c["request"].get("abort_all") in (None, False) for c in aborts)
    assert generate["status"] == 200
    finish = generate["response"]["meta_info"]["finish_reason"]
    assert finish["type"] == "abort", finish
    assert generate["response"]["meta_info"]["completion_tokens"] < 1500
    assert_engine_clean(served.engine)
    info = httpx.get(f"{served.server}/sessions/{sid}", timeout=10)
    if info.status_code == 200:
        assert info.json()["records"] == []
    assert metric(served.server, f'session_server_aborts_total{{cause="{cause}"}}') == before + 1


def aborts_before(served: Served, cause: str) -> float:
    served.proxy.clear()
    return metric(served.server, f'session_server_aborts_total{{cause="{cause}"}}', default=0.0)


def test_client_disconnect_aborts_the_engine_request(served: Served) -> None:
    sid = new_session(served.server)
    before = aborts_before(served, "disconnect")

    async def main() -> None:
        async with httpx.AsyncClient(timeout=300) as http:
            chat = asyncio.create_task(http.post(chat_url(served.server, sid), json=LONG))
            await wait_engine_running(served.engine)
            started = time.monotonic()
            chat.cancel()  # the connection closes: the client went away
            with pytest.raises(asyncio.CancelledError):
                await chat
        async with asyncio.timeout(BOUND):
            await wait_loads(served.engine, lambda report: report["num_running_reqs"] == 0)
        assert time.monotonic() - started < BOUND

    asyncio.run(main())
    assert_aborted_by_rid(served, sid, "disconnect", before)
    assert httpx.delete(f"{served.server}/sessions/{sid}", timeout=10).status_code == 204


def test_delete_during_a_chat_aborts_the_engine_request(served: Served) -> None:
    sid = new_session(served.server)
    before = aborts_before(served, "delete")

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(timeout=300) as http:
            chat = asyncio.create_task(http.post(chat_url(served.server, sid), json=LONG))
            await wait_engine_running(served.engine)
            deleted = await http.delete(f"{served.server}/sessions/{sid}")
            assert deleted.status_code == 204
            return await asyncio.wait_for(chat, BOUND)

    reply = asyncio.run(main())
    assert reply.status_code == 404, reply.text  # the session is gone; nothing was committed
    assert_aborted_by_rid(served, sid, "delete", before)


def test_request_timeout_aborts_the_engine_request(served: Served) -> None:
    sid = new_session(served.server)
    before = aborts_before(served, "timeout")
    started = time.monotonic()
    reply = httpx.post(chat_url(served.server, sid), json=LONG, timeout=60)
    elapsed = time.monotonic() - started
    assert reply.status_code == 504, reply.text
    assert TIMEOUT - 0.5 < elapsed < TIMEOUT + BOUND, elapsed  # the deadline, the abort included
    assert_aborted_by_rid(served, sid, "timeout", before)
    assert httpx.delete(f"{served.server}/sessions/{sid}", timeout=10).status_code == 204


def test_admin_pause_abort_aborts_the_engine_request_and_the_turn_is_retried(served: Served) -> None:
    sid = new_session(served.server)
    before = aborts_before(served, "pause")

    async def main() -> tuple[httpx.Response, dict[str, Any]]:
        async with httpx.AsyncClient(timeout=300) as http:
            chat = asyncio.create_task(http.post(chat_url(served.server, sid), json=LONG))
            await wait_engine_running(served.engine)
            paused = await http.post(f"{served.server}/admin/pause", json={"mode": "abort"})
            assert paused.status_code == 200 and paused.json()["aborted"] == 1, paused.text
            reply = await asyncio.wait_for(chat, BOUND)
            # The pause returned once SGLang had answered the request's end; its scheduler drops the request from
            # its running batch at its next step (0.1 s paced, longer on a loaded machine; seen as 1 running in a
            # suite run), so the engine's books are read within BOUND, not at once.
            async with asyncio.timeout(BOUND):
                await wait_loads(served.engine, lambda report: report["num_running_reqs"] == 0)
            return reply

    reply = asyncio.run(main())
    assert reply.status_code == 503 and "retry-after" in reply.headers, reply.text
    assert_aborted_by_rid(served, sid, "pause", before)
    assert httpx.post(f"{served.server}/admin/continue", timeout=10).status_code == 200
    retry = httpx.post(chat_url(served.server, sid), json={**LONG, "max_tokens": 4}, timeout=60)
    assert retry.status_code == 200, retry.text
    assert retry.json()["usage"]["completion_tokens"] == 4
    assert httpx.delete(f"{served.server}/sessions/{sid}", timeout=10).status_code == 204
