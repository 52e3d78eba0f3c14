"""Aborts the engine does not answer, through a proxy that refuses `/abort_request` (503) the way a busy or stalled
engine fails it: the abort is retried in the background until the engine answers again, and then the request ends
(finish_reason abort) and its KV is freed; an engine that never answers leaves nothing behind either (the request
ends by itself, the retry sees it and stops). Counted in /metrics (`engine_abort_retries_total{outcome}`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from support.server import (
    RecordingProxy,
    assert_engine_baseline,
    chat_url,
    engine_info,
    metric,
    new_session,
    wait_engine_idle,
)
from support.sim import wait_for
from support.stack import Stack, StackFactory

FAMILY = "qwen3"
ENDLESS = 20_000  # tokens at 20 ms each: a request that runs for minutes unless it is aborted
WAIT = 60.0  # a bound on waiting for an event, never a measure of speed


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    # A control timeout far above what an answered call takes on a loaded machine: only the refused aborts fail.
    control = ["--engine-control-timeout", "2", "--drain-timeout", str(WAIT)]
    with stack_factory(family=FAMILY, sim_args=["--enable-streaming-session", "--token-latency-ms", "20"],
                       servers={"plain": control, "es": ["--engine-sessions", *control]},
                       proxied={"plain", "es"}) as stack:
        yield stack


def _retries(server: str, outcome: str) -> float:
    return metric(server, f'session_server_engine_abort_retries_total{{outcome="{outcome}"}}', 0.0)


def _chat_in_background(server: str, sid: str, tokens: int, stream: bool) -> threading.Thread:
    body = {"messages": [{"role": "user", "content": f"go [[sim: tokens {tokens}]]"}], "max_tokens": tokens,
            "stream": stream}
    thread = threading.Thread(target=lambda: httpx.post(chat_url(server, sid), json=body, timeout=WAIT))
    thread.start()
    return thread


def _running(stack: Stack) -> None:
    wait_for(lambda: engine_info(stack.engine)["running_requests"] >= 1, WAIT)


@pytest.mark.parametrize(("name", "stream"), [("plain", False), ("es", True)])
def test_an_unanswered_abort_is_retried_until_the_engine_answers(stack: Stack, proxy: RecordingProxy, name: str,
                                                                 stream: bool) -> None:
    server = stack[name]
    retried, aborted = _retries(server, "retry"), _retries(server, "aborted")
    sid = new_session(server)
    chat = _chat_in_background(server, sid, ENDLESS, stream)
    _running(stack)
    proxy.refuse["/abort_request"] = 503
    assert httpx.delete(f"{server}/sessions/{sid}", timeout=WAIT).status_code == 204  # aborts the chat
    chat.join()
    wait_for(lambda: _retries(server, "retry") > retried, WAIT)
    assert engine_info(stack.engine)["running_requests"] == 1  # refused: the engine still generates
    assert metric(server, "session_server_engine_retries_pending") >= 1
    proxy.refuse.clear()  # the engine answers again
    wait_engine_idle(stack.engine, WAIT)
    wait_for(lambda: _retries(server, "aborted") == aborted + 1, WAIT)
    wait_for(lambda: metric(server, "session_server_engine_retries_pending") == 0, WAIT)
    (generate,) = [c for c in proxy.settled(WAIT) if c["path"] == "/generate"]
    assert generate["response"]["meta_info"]["finish_reason"]["type"] == "abort"  # ended by the abort, not its end
    assert_engine_baseline(stack.engine)


@pytest.mark.parametrize("name", ["plain", "es"])
def test_an_abort_the_engine_never_answers_leaves_nothing_behind(stack: Stack, proxy: RecordingProxy,
                                                                 name: str) -> None:
    """The engine never takes the abort, but the request ends without it (here another party aborts it on the engine
    directly): the retry sees its connection end and stops, and nothing is left: no retry, no running request, no
    engine session, no KV."""
    server = stack[name]
    retried, moot, aborted = _retries(server, "retry"), _retries(server, "moot"), _retries(server, "aborted")
    proxy.refuse["/abort_request"] = 503
    sid = new_session(server)
    chat = _chat_in_background(server, sid, ENDLESS, stream=False)
    _running(stack)
    assert httpx.delete(f"{server}/sessions/{sid}", timeout=WAIT).status_code == 204
    chat.join()
    wait_for(lambda: _retries(server, "retry") > retried, WAIT)
    (generate,) = [c for c in proxy.calls if c["path"] == "/generate"]
    assert httpx.post(f"{stack.engine}/abort_request", json={"rid": generate["request"]["rid"]}).status_code == 200
    wait_for(lambda: _retries(server, "moot") == moot + 1, WAIT)
    wait_for(lambda: metric(server, "session_server_engine_retries_pending") == 0, WAIT)
    assert _retries(server, "aborted") == aborted  # none of ours landed
    assert_engine_baseline(stack.engine)


def test_a_pause_waits_for_a_retried_abort_so_the_engine_is_quiet(stack: Stack, proxy: RecordingProxy) -> None:
    """/admin/pause mode abort returns once the engine is quiet for the weight update: an abort the engine does not
    answer is waited for (until the drain deadline) while it is retried, and the pause returns once it landed."""
    server = stack["plain"]
    retried = _retries(server, "retry")
    sid = new_session(server)
    chat = _chat_in_background(server, sid, ENDLESS, stream=False)
    wait_for(lambda: engine_info(stack.engine)["running_requests"] >= 1, WAIT)
    proxy.refuse["/abort_request"] = 503
    with ThreadPoolExecutor(1) as pool:
        pause = pool.submit(httpx.post, f"{server}/admin/pause", json={"mode": "abort"}, timeout=WAIT)
        chat.join()  # aborted at once: 503 + Retry-After
        wait_for(lambda: _retries(server, "retry") > retried, WAIT)
        assert not pause.done()  # the engine still runs the request: the pause waits
        proxy.refuse.clear()
        assert pause.result().status_code == 200
    try:
        assert engine_info(stack.engine)["running_requests"] == 0  # quiet when the pause returned
    finally:
        assert httpx.post(f"{server}/admin/continue", timeout=WAIT).status_code == 200
    assert httpx.delete(f"{server}/sessions/{sid}", timeout=WAIT).status_code == 204
    assert_engine_baseline(stack.engine)
