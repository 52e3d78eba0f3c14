"""GET /metrics of a real session server in front of the sim: what an operator scrapes is what happened.

Each scenario reads the exposition before and after and checks the difference: responses by route template and
status (every response once, including the 404 of an unknown session and a refused engine reply), tokens of committed
turns against the usage the agent received, rollbacks, validation failures by rule, aborts by cause, the stage and
latency histograms, the live gauges and the event-loop lag ticker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.server import assert_engine_baseline, chat_url, new_session, wait_engine_idle, wait_running
from support.stack import Stack, StackFactory

FAMILY = "qwen3"
TOKEN_MS = 5
CHAT_ROUTE = "/sessions/{session_id}/v1/chat/completions"
SESSION_ROUTE = "/sessions/{session_id}"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(family=FAMILY, sim_args=["--token-latency-ms", str(TOKEN_MS)]) as stack:
        yield stack


def scrape(server: str) -> Samples:
    resp = httpx.get(f"{server}/metrics", timeout=10)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    out: Samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def responses(samples: Samples, route: str, method: str, status: int) -> float:
    return value(samples, "session_server_responses_total", route=route, method=method, status=str(status))


def test_responses_tokens_and_latencies(stack: Stack) -> None:
    server = stack.server
    before = scrape(server)
    sid = new_session(server)
    history = [{"role": "user", "content": "hello [[sim: tokens 5]]"}]
    first = httpx.post(chat_url(server, sid), json={"messages": history}, timeout=30)
    assert first.status_code == 200
    history += [first.json()["choices"][0]["message"], {"role": "user", "content": "again [[sim: tokens 4]]"}]
    second = httpx.post(chat_url(server, sid), json={"messages": history}, timeout=30)
    assert second.status_code == 200
    assert httpx.post(chat_url(server, "0" * 32), json={"messages": history}).status_code == 404
    assert httpx.get(f"{server}/sessions/{sid}").status_code == 200
    assert httpx.get(f"{server}/no/such/path").status_code == 404
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert responses(after, CHAT_ROUTE, "POST", 200) - responses(before, CHAT_ROUTE, "POST", 200) == 2
    assert responses(after, CHAT_ROUTE, "POST", 404) - responses(before, CHAT_ROUTE, "POST", 404) == 1
    assert responses(after, SESSION_ROUTE, "GET", 200) - responses(before, SESSION_ROUTE, "GET", 200) == 1
    assert responses(after, SESSION_ROUTE, "DELETE", 204) - responses(before, SESSION_ROUTE, "DELETE", 204) == 1
    assert responses(after, "<unmatched>", "GET", 404) - responses(before, "<unmatched>", "GET", 404) == 1
    assert not any(k[0] == "session_server_responses_total" and sid in str(k) for k in after)  # no raw paths

    usage = [r.json()["usage"] for r in (first, second)]
    assert delta("session_server_tokens_total", kind="prompt") == sum(u["prompt_tokens"] for u in usage)
    assert delta("session_server_tokens_total", kind="completion") == sum(u["completion_tokens"] for u in usage)
    assert delta("session_server_tokens_total", kind="cached") > 0  # the second turn reuses the first one's prefix
    for stage in ("prepare", "decode", "commit"):
        assert delta("session_server_stage_seconds_count", stage=stage) == 2
    assert delta("session_server_chat_seconds_count") == 2
    assert delta("session_server_engine_seconds_count") == 2
    assert delta("session_server_added_seconds_count") == 2
    # The engine generated 9 tokens at TOKEN_MS each: the chats took at least that, the engine part included.
    assert delta("session_server_engine_seconds_sum") >= 9 * TOKEN_MS / 1000
    assert delta("session_server_chat_seconds_sum") >= delta("session_server_engine_seconds_sum")
    assert delta("session_server_sessions_created_total") == 1
    # The loop-lag ticker reports every 0.1 s from the server's start; a test this quick may scrape before its first.
    deadline = time.monotonic() + 60
    while value(after, "session_server_event_loop_lag_seconds_count") == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        after = scrape(server)
    assert value(after, "session_server_event_loop_lag_seconds_count") > 0
    assert value(after, "process_resident_memory_bytes") > 0
    assert_engine_baseline(stack.engine)


def test_rollback_and_validation_failure_are_counted(stack: Stack) -> None:
    server, engine = stack.server, stack.engine
    sid = new_session(server)
    history = [{"role": "system", "content": "s"}, {"role": "user", "content": "one [[sim: tokens 3]]"}]
    first = httpx.post(chat_url(server, sid), json={"messages": history}, timeout=30)
    assert first.status_code == 200
    before = scrape(server)
    # Regenerate the first turn: the history diverges inside the stored turn, a one-step rollback (sharing the first
    # message: a request that shares none starts a segment, trajectory/session_segments.py).
    retry = httpx.post(chat_url(server, sid), json={"messages": [
        history[0], history[1] | {"content": "uno [[sim: tokens 3]]"}]})
    assert retry.status_code == 200
    assert httpx.post(f"{engine}/sim/faults", json={"nan_logprob": 1.0}).status_code == 200
    try:
        bad = httpx.post(chat_url(server, sid), json={"messages": history}, timeout=30)
    finally:
        httpx.post(f"{engine}/sim/faults", json={})
    assert bad.status_code == 502
    rule = bad.json()["error"]["rule"]
    after = scrape(server)
    assert value(after, "session_server_rollbacks_total", reason="content") - value(
        before, "session_server_rollbacks_total", reason="content") == 1
    assert value(after, "session_server_engine_validation_failures_total", rule=rule) - value(
        before, "session_server_engine_validation_failures_total", rule=rule) == 1
    assert responses(after, CHAT_ROUTE, "POST", 502) - responses(before, CHAT_ROUTE, "POST", 502) == 1
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(engine)


def test_aborts_by_cause_and_live_gauges(stack: Stack) -> None:
    server, engine = stack.server, stack.engine
    # 100 s at the engine: both chats are cut long before their end, however slow the machine
    long_chat = {"messages": [{"role": "user", "content": "long [[sim: tokens 20000]]"}], "max_tokens": 20000}
    before = scrape(server)
    gone, kept = new_session(server), new_session(server)

    async def main() -> tuple[int, Samples]:
        async with httpx.AsyncClient(timeout=60) as http:
            # A client that goes away mid-chat.
            chat = asyncio.ensure_future(http.post(chat_url(server, kept), json=long_chat))
            await wait_running(engine, 1)
            during = scrape(server)
            chat.cancel()
            with pytest.raises(asyncio.CancelledError):
                await chat
            # the disconnect's abort lands first, so the engine request waited for next is the DELETE's chat
            await asyncio.to_thread(wait_engine_idle, engine)
            # A DELETE that cuts a chat off.
            chat = asyncio.ensure_future(http.post(chat_url(server, gone), json=long_chat))
            await wait_running(engine, 1)
            assert (await http.delete(f"{server}/sessions/{gone}")).status_code == 204
            return (await chat).status_code, during

    status, during = asyncio.run(main())
    assert status == 404
    assert value(during, "session_server_in_flight") == 1
    assert value(during, "session_server_in_flight_at_engine") == 1  # its request reached the engine
    assert value(during, "session_server_sessions") == value(before, "session_server_sessions") + 2
    deadline = time.monotonic() + 60
    while value(after := scrape(server), "session_server_aborts_total", cause="disconnect") == value(
        before, "session_server_aborts_total", cause="disconnect"
    ):
        assert time.monotonic() < deadline, "the disconnect was never counted"
        time.sleep(0.02)
    for cause, n in (("disconnect", 1), ("delete", 1), ("pause", 0), ("timeout", 0), ("expiry", 0)):
        assert value(after, "session_server_aborts_total", cause=cause) - value(
            before, "session_server_aborts_total", cause=cause) == n, cause
    assert value(after, "session_server_engine_aborts_total") - value(before, "session_server_engine_aborts_total") == 2
    assert value(after, "session_server_in_flight") == 0
    assert httpx.delete(f"{server}/sessions/{kept}").status_code == 204
    assert value(scrape(server), "session_server_sessions") == value(before, "session_server_sessions")
    assert_engine_baseline(engine)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_a_pause_abort_is_counted_as_a_pause_whether_streamed_or_not(stack: Stack, stream: bool) -> None:
    """One pipeline, one count: a chat cut off by `/admin/pause` mode abort is a `pause` abort, plain or streamed
    (the streamed copy of the turn's tail once counted it as an abort by the engine)."""
    server, engine = stack.server, stack.engine
    sid = new_session(server)
    before = scrape(server)

    async def main() -> int:
        async with httpx.AsyncClient(timeout=60) as http:
            chat = asyncio.ensure_future(http.post(chat_url(server, sid), json={  # 100 s unless cut: it is cut
                "messages": [{"role": "user", "content": "long [[sim: tokens 20000]]"}], "max_tokens": 20000,
                "stream": stream}))
            await wait_running(engine, 1)
            paused = await http.post(f"{server}/admin/pause", json={"mode": "abort"})
            assert paused.status_code == 200 and paused.json()["aborted"] == 1, paused.text
            try:
                reply = await chat
            finally:
                assert (await http.post(f"{server}/admin/continue")).status_code == 200
            if stream and reply.status_code == 200:  # aborted after the first byte: an error event ends it
                assert '"session_paused"' in reply.text, reply.text
                return 503
            return reply.status_code

    assert asyncio.run(main()) == 503
    after = scrape(server)
    for cause, n in (("pause", 1), ("engine", 0), ("disconnect", 0)):
        assert value(after, "session_server_aborts_total", cause=cause) - value(
            before, "session_server_aborts_total", cause=cause) == n, cause
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(engine)
