"""Engine sessions that cannot leak or break (issue 9 point 6).

`open_session` always carries a `timeout` (our idle timeout plus a margin), so a crashed session server's engine
sessions are reclaimed by the engine; and when the engine no longer holds a session -- its idle timeout closed it,
or it restarted -- the next turn's 400 "session id ... does not exist" (scheduler.py handle_generate_request) is
never shown to the agent: the server reopens the session and resends the whole prompt, once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from harness.launchers import start_sim
from support.server import chat_url, new_session, wait_engine_sessions
from support.stack import Stack, StackFactory

FAMILY = "qwen3"
IDLE = 100
SIM_ARGS = ("--enable-streaming-session", "--token-latency-ms", "2")


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(
        family=FAMILY, sim_args=SIM_ARGS,
        servers={"server": ["--engine-sessions", "--session-idle-timeout", str(IDLE), "--request-timeout", "30"],
                 "slow_turns": ["--engine-sessions", "--session-idle-timeout", str(IDLE), "--request-timeout", "600"]},
        proxied={"server", "slow_turns"},
    ) as stack:
        yield stack


def _turns(server: str, sid: str, history: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    for i in range(n):
        history.append({"role": "user", "content": f"turn {len(history)} {i} [[sim: tokens 4]]"})
        r = httpx.post(chat_url(server, sid), json={"messages": history}, timeout=30)
        assert r.status_code == 200, r.text
        history.append(r.json()["choices"][0]["message"])
    return history


def _tokens(server: str, sid: str) -> list[int]:
    return httpx.get(f"{server}/sessions/{sid}", timeout=10).json()["token_ids"]


def test_open_session_carries_the_idle_timeout_plus_a_margin(stack: Stack) -> None:
    assert stack.proxy is not None
    stack.proxy.clear()
    sid = new_session(stack.server)
    _turns(stack.server, sid, [], 2)  # the engine session is opened at the second turn
    opens = [c for c in stack.proxy.calls if c["path"] == "/open_session"]
    assert len(opens) == 1 and opens[0]["request"]["timeout"] == IDLE + 60 and opens[0]["request"]["streaming"]
    assert httpx.delete(f"{stack.server}/sessions/{sid}").status_code == 204


def test_the_engine_session_outlives_the_longest_turn(stack: Stack) -> None:
    """SGLang counts a session's idleness from the start of its last request, and a streaming session that times out
    while its request runs kills SGLang 0.5.23's scheduler (seen on the real engine): the engine timeout is never
    shorter than --request-timeout plus the margin."""
    assert stack.proxy is not None
    stack.proxy.clear()
    sid = new_session(stack["slow_turns"])
    _turns(stack["slow_turns"], sid, [], 2)
    (opened,) = [c for c in stack.proxy.calls if c["path"] == "/open_session"]
    assert opened["request"]["timeout"] == 600 + 60
    assert httpx.delete(f"{stack['slow_turns']}/sessions/{sid}").status_code == 204


def test_session_closed_by_the_engine_is_reopened_transparently(stack: Stack) -> None:
    assert stack.proxy is not None
    sid = new_session(stack.server)
    history = _turns(stack.server, sid, [], 2)
    engine_sid = [c for c in stack.proxy.calls if c["path"] == "/open_session"][-1]["response"]
    assert httpx.post(f"{stack.engine}/close_session", json={"session_id": engine_sid}).status_code == 200
    stack.proxy.clear()
    before = _tokens(stack.server, sid)
    _turns(stack.server, sid, history, 1)
    paths = [(c["path"], c["status"]) for c in stack.proxy.calls if c["path"] in ("/generate", "/open_session")]
    assert paths == [("/generate", 400), ("/open_session", 200), ("/generate", 200)], paths
    refused, resent = stack.proxy.generates()
    assert "does not exist" in refused["response"]["error"]["message"]
    assert len(resent["request"]["input_ids"]) > len(refused["request"]["input_ids"])  # the whole prompt again
    after = _tokens(stack.server, sid)
    assert after[: len(before)] == before
    assert httpx.delete(f"{stack.server}/sessions/{sid}").status_code == 204


def test_engine_restart_is_survived_without_a_400(stack: Stack) -> None:
    sid = new_session(stack.server)
    history = _turns(stack.server, sid, [], 2)
    old = stack.procs[0]
    port = old.port
    old.stop()
    new = start_sim(stack.tok, FAMILY, *SIM_ARGS, "--port", str(port), log_dir=stack.logs)
    try:
        _turns(stack.server, sid, history, 2)
        info = httpx.get(f"{stack.engine}/server_info").json()
        assert info["open_sessions"] == 1
        assert httpx.delete(f"{stack.server}/sessions/{sid}").status_code == 204
        assert wait_engine_sessions(stack.engine, 0)["open_sessions"] == 0  # closed after the DELETE answered
    finally:
        stack.procs[0] = new  # the stack stops the engine that is running at teardown


def test_immediate_retry_after_a_disconnect_is_never_409_nor_concurrent(stack: Stack) -> None:
    """Issue 9 point 9: the slot is free as soon as the client is gone; the retry waits (bounded) for its dead
    request to end on the engine, so the engine never runs two requests of the session at once."""
    import asyncio

    from support.server import wait_running

    assert stack.proxy is not None
    sid = new_session(stack.server)
    history = _turns(stack.server, sid, [], 1)
    history.append({"role": "user", "content": "long [[sim: tokens 3000]]"})
    body = {"messages": history, "max_tokens": 100}
    stack.proxy.clear()

    async def main() -> int:
        async with httpx.AsyncClient(timeout=30) as first:
            task = asyncio.ensure_future(first.post(chat_url(stack.server, sid), json={**body, "max_tokens": 4000}))
            await wait_running(stack.engine)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        async with httpx.AsyncClient(timeout=30) as second:  # at once, on a new connection
            return (await second.post(chat_url(stack.server, sid), json=body)).status_code

    assert asyncio.run(main()) == 200
    generates = stack.proxy.generates()
    assert len(generates) == 2
    assert generates[1]["started"] >= generates[0]["finished"]  # never two requests of the session at once
    assert httpx.delete(f"{stack.server}/sessions/{sid}").status_code == 204
