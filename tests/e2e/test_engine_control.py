"""Engine control calls when the engine is slow or failing (--engine-sessions), through a proxy that delays or refuses
them: an open on a turn's path waits for what the turn's deadline allows, not the 1 s control timeout; an open that
fails sends the turn without an engine session (counted), never a 502; a close that fails is retried in the
background until it lands, and the engine is left with nothing open. (The burst of new sessions under CPU contention:
tests/e2e/test_faults_under_contention.py.)"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from support.server import RecordingProxy, assert_engine_baseline, chat_url, engine_info, metric, new_session
from support.stack import Stack, StackFactory

FAMILY = "qwen3"
CHAT = {"messages": [{"role": "user", "content": "hi [[sim: tokens 3]]"}]}
CONTROL_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    # A control timeout of 2 s: far above what an answered control call takes on a loaded machine, so only the calls
    # the proxy delays or refuses fail; the delayed open waits 1.5 times that.
    with stack_factory(family=FAMILY, sim_args=["--enable-streaming-session"],
                       servers={"es": ["--engine-sessions", "--engine-control-timeout", str(CONTROL_TIMEOUT)]},
                       proxied={"es"}) as stack:
        yield stack


def _generates(proxy: RecordingProxy) -> list[dict[str, object]]:
    return [c["request"] for c in proxy.settled() if c["path"] == "/generate"]


def _second_turn(server: str, sid: str, proxy: RecordingProxy) -> dict[str, object]:
    """The session's first turn (which opens no engine session: nothing to reuse), and the body of its second, which
    opens one; the proxy's record starts after the first."""
    history: list[object] = [CHAT["messages"][0]]
    r = httpx.post(chat_url(server, sid), json={"messages": history}, timeout=30)
    assert r.status_code == 200, r.text
    history += [r.json()["choices"][0]["message"], {"role": "user", "content": "again [[sim: tokens 3]]"}]
    proxy.clear()
    return {"messages": history}


def test_a_slow_open_on_a_turns_path_gets_the_turns_deadline(stack: Stack, proxy: RecordingProxy) -> None:
    sid = new_session(stack["es"])
    second = _second_turn(stack["es"], sid, proxy)
    proxy.delay["/open_session"] = 1.5 * CONTROL_TIMEOUT  # the open answers after the control timeout
    r = httpx.post(chat_url(stack["es"], sid), json=second, timeout=30)
    assert r.status_code == 200, r.text
    (generate,) = _generates(proxy)
    assert generate["session_params"]  # the turn ran in the engine session it waited for
    assert httpx.delete(f"{stack['es']}/sessions/{sid}").status_code == 204
    assert_engine_baseline(stack.engine)


def test_an_open_that_fails_degrades_to_a_plain_turn(stack: Stack, proxy: RecordingProxy) -> None:
    server = stack["es"]
    before = metric(server, "session_server_engine_session_fallbacks_total")
    sid = new_session(server)
    history = _second_turn(server, sid, proxy)["messages"]
    assert metric(server, "session_server_engine_session_fallbacks_total") == before  # a first turn opens none
    proxy.refuse["/open_session"] = 503
    r = httpx.post(chat_url(server, sid), json={"messages": history}, timeout=30)
    assert r.status_code == 200, r.text
    assert metric(server, "session_server_engine_session_fallbacks_total") == before + 1
    (generate,) = _generates(proxy)
    assert "session_params" not in generate or generate["session_params"] is None  # the whole prompt, no session
    proxy.refuse.clear()
    history += [r.json()["choices"][0]["message"], {"role": "user", "content": "again [[sim: tokens 3]]"}]
    assert httpx.post(chat_url(server, sid), json={"messages": history}, timeout=30).status_code == 200
    assert _generates(proxy)[-1]["session_params"]  # the engine answers again: the next turn opens one
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(stack.engine)


def test_a_failed_close_is_retried_until_it_lands(stack: Stack, proxy: RecordingProxy) -> None:
    server = stack["es"]
    sid = new_session(server)
    assert httpx.post(chat_url(server, sid), json=_second_turn(server, sid, proxy), timeout=30).status_code == 200
    assert engine_info(stack.engine)["open_sessions"] == 1
    closed = metric(server, 'session_server_engine_close_retries_total{outcome="closed"}', 0.0)
    retried = metric(server, 'session_server_engine_close_retries_total{outcome="retry"}', 0.0)
    proxy.refuse["/close_session"] = 503
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204  # DELETE does not wait for the engine
    deadline = time.monotonic() + 60
    while metric(server, 'session_server_engine_close_retries_total{outcome="retry"}', 0.0) == retried:
        assert time.monotonic() < deadline, "the failed close was never retried"
        time.sleep(0.05)  # a retry fails while the engine refuses
    assert engine_info(stack.engine)["open_sessions"] == 1
    proxy.refuse.clear()
    deadline = time.monotonic() + 60
    # the engine frees the session before the server hears back and counts it: wait for the count, then check both
    while metric(server, 'session_server_engine_close_retries_total{outcome="closed"}', 0.0) == closed:
        assert time.monotonic() < deadline, "the close never landed"
        time.sleep(0.05)
    assert metric(server, 'session_server_engine_close_retries_total{outcome="closed"}') == closed + 1
    assert engine_info(stack.engine)["open_sessions"] == 0
    assert_engine_baseline(stack.engine)
