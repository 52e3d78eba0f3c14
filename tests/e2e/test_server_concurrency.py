"""The in-flight gate and every way a chat can end early, against real processes with a slow engine.

The engine emits one token every TOKEN_MS, so a scripted long reply parks its chat at the engine for seconds while
the test races contenders, DELETEs, disconnects, pauses and faults against it. Every scenario ends with the engine
at its baseline: nothing running, no session held, no KV slot in use after a cache flush, books balanced.

No verdict depends on the machine's speed (issue 30): a chat that is cut short (DELETE, disconnect, pause, timeout)
asks for ENDLESS tokens, minutes at the engine, so it is still running whenever the cut comes and an uncut one could
never pass for a cut one; a chat that must finish while others race it asks for LONG tokens, several seconds, an
order of magnitude more than the few requests the race takes, and what the race must answer at once is bounded by a
third of that.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from sglang_sim.faults import FAILING_FAULTS
from support.server import (
    assert_engine_baseline,
    chat_url,
    engine_info,
    metric,
    new_session,
    wait_emitted,
    wait_engine_idle,
    wait_running,
)
from support.stack import Stack, StackFactory
from trajectory import samples_from_json

FAMILY = "qwen3"
TOKEN_MS = 10
LONG = 600  # tokens: 6 s at the engine, for a chat that runs to its end while the test races others against it
LONG_CHAT = {"messages": [{"role": "user", "content": f"take your time [[sim: tokens {LONG}]]"}]}
ENDLESS = 20_000  # tokens: 200 s at the engine, for a chat the test cuts short
ENDLESS_CHAT = {"messages": [{"role": "user", "content": f"go on and on [[sim: tokens {ENDLESS}]]"}],
                "max_tokens": ENDLESS}
CUT_WITHIN = 20.0  # seconds: a cut chat ends far sooner than its ENDLESS reply, whatever the machine's load
SHORT_CHAT = {"messages": [{"role": "user", "content": "quick [[sim: tokens 2]]"}]}
ADMIN = {"Authorization": "Bearer s3cret"}
BODY_FAULTS = tuple(f for f in FAILING_FAULTS if f != "http_500")  # http_500 passes through with its status


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(
        family=FAMILY,
        sim_args=["--token-latency-ms", str(TOKEN_MS)],
        servers={"server": ["--admin-token", "s3cret"], "timeout_server": ["--request-timeout", "0.5"],
                 "one_line": ["--on-divergence", "reject"]},
    ) as stack:
        yield stack


@pytest.fixture
def faults(stack: dict[str, str]) -> Iterator[None]:
    yield
    httpx.post(f"{stack['engine']}/sim/faults", json={})


def test_race_contract_contenders_get_409_at_once(stack: dict[str, str]) -> None:
    """Contenders for the segment in flight (here: the same first turn again) are refused at once. Requests that
    start another segment run beside it (tests/e2e/test_server_segments.py)."""
    server, engine = stack["server"], stack["engine"]
    sid = new_session(server)
    before = engine_info(engine)["finished_requests"]

    async def main() -> tuple[httpx.Response, list[tuple[int, float]]]:
        async with httpx.AsyncClient(timeout=60) as http:
            owner = asyncio.ensure_future(http.post(chat_url(server, sid), json=LONG_CHAT))
            await wait_running(engine, 1)

            async def contend() -> tuple[int, float]:
                started = time.monotonic()
                resp = await http.post(chat_url(server, sid), json=LONG_CHAT)
                return resp.status_code, time.monotonic() - started

            contenders = await asyncio.gather(*(contend() for _ in range(3)))
            assert not owner.done()
            return await owner, contenders

    owner, contenders = asyncio.run(main())
    assert owner.status_code == 200
    for status, elapsed in contenders:
        assert status == 409
        assert elapsed < LONG * TOKEN_MS / 1000 / 3  # well under the owner's engine latency
    assert engine_info(engine)["finished_requests"] - before == 1  # contenders never reached the engine
    follow = [*LONG_CHAT["messages"], owner.json()["choices"][0]["message"], SHORT_CHAT["messages"][0]]
    assert httpx.post(chat_url(server, sid), json={"messages": follow}).status_code == 200
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(engine)


def test_busy_409_never_reads_the_body(stack: dict[str, str]) -> None:
    """A single-line session (--on-divergence reject) knows a second request is for its busy segment before reading
    it; with segments the body says which segment a request is for (it may start another)."""
    server, engine = stack["one_line"], stack["engine"]
    sid = new_session(server)
    host, port = urlsplit(server).hostname, urlsplit(server).port

    async def main() -> tuple[int, bytes]:
        async with httpx.AsyncClient(timeout=60) as http:
            owner = asyncio.ensure_future(http.post(chat_url(server, sid), json=LONG_CHAT))
            await wait_running(engine, 1)
            # Headers promise a 1 MB body and none of it is sent: the 409 must come anyway.
            with socket.create_connection((host, port), timeout=5) as sock:
                head = (
                    f"POST /sessions/{sid}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                    "Content-Type: application/json\r\nContent-Length: 1000000\r\n\r\n"
                )
                sock.sendall(head.encode())
                reply = await asyncio.to_thread(sock.recv, 65536)
            resp = await owner
            return resp.status_code, reply

    owner_status, reply = asyncio.run(main())
    assert reply.startswith(b"HTTP/1.1 409"), reply[:200]
    assert owner_status == 200
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(engine)


def test_delete_does_not_wait_for_a_slow_request_body(stack: dict[str, str]) -> None:
    server, engine = stack["server"], stack["engine"]
    sid = new_session(server)
    host, port = urlsplit(server).hostname, urlsplit(server).port
    with socket.create_connection((host, port), timeout=60) as sock:
        head = (
            f"POST /sessions/{sid}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"messages\": ["
        )
        sock.sendall(head.encode())  # the chat holds the slot, its body never completes
        deadline = time.monotonic() + 60
        while metric(server, "session_server_in_flight") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # The body would take --body-timeout (30 s) to time out: the DELETE's answer comes long before.
        assert httpx.delete(f"{server}/sessions/{sid}", timeout=CUT_WITHIN).status_code == 204
        assert sock.recv(65536).startswith(b"HTTP/1.1 404")
    assert engine_info(engine)["running_requests"] == 0


def test_sessions_run_in_parallel(stack: dict[str, str]) -> None:
    server, engine = stack["server"], stack["engine"]
    sids = [new_session(server) for _ in range(4)]

    async def main() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as http:
            chats = [asyncio.ensure_future(http.post(chat_url(server, s), json=LONG_CHAT)) for s in sids]
            await wait_running(engine, 4)  # all four are at the engine at the same time
            return [r.status_code for r in await asyncio.gather(*chats)]

    assert asyncio.run(main()) == [200] * 4
    for sid in sids:
        assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(engine)


def test_delete_during_chat_aborts_it(stack: dict[str, str]) -> None:
    server, engine = stack["server"], stack["engine"]
    sid = new_session(server)

    async def main() -> tuple[int, int, int, int]:
        async with httpx.AsyncClient(timeout=60) as http:
            chat = asyncio.ensure_future(http.post(chat_url(server, sid), json=ENDLESS_CHAT))
            await wait_running(engine, 1)
            started = time.monotonic()
            deleted = await http.delete(f"{server}/sessions/{sid}")
            assert time.monotonic() - started < CUT_WITHIN  # the engine call was aborted, not waited for
            late = await http.post(chat_url(server, sid), json=SHORT_CHAT)
            again = await http.delete(f"{server}/sessions/{sid}")
            return deleted.status_code, (await chat).status_code, late.status_code, again.status_code

    assert asyncio.run(main()) == (204, 404, 404, 404)
    assert httpx.get(f"{server}/sessions/{sid}").status_code == 404
    assert_engine_baseline(engine)


def test_client_disconnect_aborts_the_engine_request(stack: dict[str, str]) -> None:
    server, engine = stack["server"], stack["engine"]
    sid = new_session(server)
    aborts = metric(server, "session_server_engine_aborts_total")
    engine_aborts = engine_info(engine)["aborted_requests"]

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60) as http:
            chat = asyncio.ensure_future(http.post(chat_url(server, sid), json=ENDLESS_CHAT))
            await wait_running(engine, 1)
            chat.cancel()  # closes the connection mid-request
            with pytest.raises(asyncio.CancelledError):
                await chat

    asyncio.run(main())
    assert wait_engine_idle(engine, timeout=CUT_WITHIN)["aborted_requests"] == engine_aborts + 1  # cut, not finished
    deadline = time.monotonic() + 60
    while metric(server, "session_server_in_flight") != 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert metric(server, "session_server_engine_aborts_total") == aborts + 1
    assert httpx.get(f"{server}/sessions/{sid}").json()["records"] == []  # nothing committed
    # The agent may retry the same turn at once.
    assert httpx.post(chat_url(server, sid), json=SHORT_CHAT).status_code == 200
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(engine)


def test_pause_abort_then_continue(stack: dict[str, str]) -> None:
    server, engine = stack["server"], stack["engine"]
    sid, other = new_session(server), new_session(server)
    assert httpx.post(f"{server}/admin/pause", json={"mode": "abort"}).status_code == 401  # token required

    engine_aborts = engine_info(engine)["aborted_requests"]

    async def main() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as http:
            chat = asyncio.ensure_future(http.post(chat_url(server, sid), json=ENDLESS_CHAT))
            await wait_running(engine, 1)
            assert (await http.get(f"{server}/admin/sessions")).status_code == 401  # the listing too
            listing = (await http.get(f"{server}/admin/sessions", headers=ADMIN)).json()
            live = {entry["id"]: entry for entry in listing["sessions"]}
            assert live[sid]["in_flight"] and not live[other]["in_flight"] and listing["total"] >= 2, listing
            newest = (await http.get(f"{server}/admin/sessions?limit=1", headers=ADMIN)).json()["sessions"]
            assert [entry["id"] for entry in newest] == [sid]  # the most recently active first
            paused = await http.post(f"{server}/admin/pause", json={"mode": "abort"}, headers=ADMIN)
            assert paused.status_code == 200
            refused = await http.post(chat_url(server, other), json=SHORT_CHAT)
            return await chat, refused

    aborted, refused = asyncio.run(main())
    for resp in (aborted, refused):
        assert resp.status_code == 503
        assert int(resp.headers["retry-after"]) >= 1
    assert wait_engine_idle(engine, timeout=CUT_WITHIN)["aborted_requests"] == engine_aborts + 1
    assert httpx.get(f"{server}/sessions/{sid}").json()["records"] == []
    assert httpx.post(f"{server}/admin/continue", headers=ADMIN).status_code == 200
    assert httpx.post(chat_url(server, sid), json=SHORT_CHAT).status_code == 200
    for s in (sid, other):
        assert httpx.delete(f"{server}/sessions/{s}").status_code == 204
    assert_engine_baseline(engine)


def test_pause_drain_waits_for_in_flight_chats(stack: dict[str, str]) -> None:
    server, engine = stack["server"], stack["engine"]
    sid = new_session(server)
    medium = {"messages": [{"role": "user", "content": "medium [[sim: tokens 50]]"}]}

    async def main() -> tuple[int, bool]:
        async with httpx.AsyncClient(timeout=60) as http:
            chat = asyncio.ensure_future(http.post(chat_url(server, sid), json=medium))
            await wait_running(engine, 1)
            paused = await http.post(f"{server}/admin/pause", json={"mode": "drain"}, headers=ADMIN)
            assert paused.status_code == 200
            return (await chat).status_code, chat.done()

    assert asyncio.run(main()) == (200, True)
    assert httpx.post(chat_url(server, sid), json=SHORT_CHAT).status_code == 503
    assert httpx.post(f"{server}/admin/continue", headers=ADMIN).status_code == 200
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(engine)


def test_pause_in_place_keeps_in_flight_chats_across_a_weight_update(stack: dict[str, str]) -> None:
    """Mode in_place: new chats are refused, the in-flight one stays parked in the engine (SGLang's own in_place
    pause) while the weights change, and completes after continue with each token's weight version recorded."""
    server, engine = stack["server"], stack["engine"]
    sid, other = new_session(server), new_session(server)

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as http:
            chat = asyncio.ensure_future(http.post(chat_url(server, sid), json=LONG_CHAT))
            await wait_running(engine, 1)
            await asyncio.to_thread(wait_emitted, engine, 20)  # some tokens under the old weights
            paused = await http.post(f"{server}/admin/pause", json={"mode": "in_place"}, headers=ADMIN)
            assert paused.status_code == 200 and paused.json() == {"status": "paused", "mode": "in_place",
                                                                   "aborted": 0}
            info = engine_info(engine)
            assert info["paused"] and info["pause_mode"] == "in_place" and info["running_requests"] == 1
            refused = await http.post(chat_url(server, other), json=SHORT_CHAT)
            assert refused.status_code == 503 and "retry-after" in refused.headers
            updated = await http.post(f"{engine}/update_weight_version",
                                      json={"new_version": "step-2", "abort_all_requests": False})
            assert updated.status_code == 200
            assert not chat.done()
            resumed = await http.post(f"{server}/admin/continue", headers=ADMIN)
            assert resumed.status_code == 200 and not engine_info(engine)["paused"]
            return await chat

    reply = asyncio.run(main())
    assert reply.status_code == 200, reply.text
    sample = samples_from_json(httpx.post(f"{server}/sessions/{sid}/samples", json={}).json())[0]
    spans = sample.metadata["weight_version_spans"]
    assert [v for v, _, _ in spans] == ["default", "step-2"] and spans[0][2] == spans[1][1], spans
    httpx.post(f"{engine}/update_weight_version", json={"new_version": "default", "abort_all_requests": False})
    for s in (sid, other):
        assert httpx.delete(f"{server}/sessions/{s}").status_code == 204
    assert_engine_baseline(engine)


def test_request_timeout_aborts_and_answers_504(stack: dict[str, str]) -> None:
    server, engine = stack["timeout_server"], stack["engine"]
    sid = new_session(server)
    engine_aborts = engine_info(engine)["aborted_requests"]
    resp = httpx.post(chat_url(server, sid), json=ENDLESS_CHAT, timeout=60)
    assert resp.status_code == 504
    assert wait_engine_idle(engine, timeout=CUT_WITHIN)["aborted_requests"] == engine_aborts + 1
    assert httpx.get(f"{server}/sessions/{sid}").json()["records"] == []
    assert httpx.post(chat_url(server, sid), json=SHORT_CHAT).status_code == 200
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(engine)


@pytest.mark.parametrize("fault", BODY_FAULTS)
def test_malformed_engine_output_is_502_and_commits_nothing(
    stack: dict[str, str], faults: None, fault: str
) -> None:
    server, engine = stack["server"], stack["engine"]
    sid = new_session(server)
    history = [{"role": "user", "content": "first [[sim: tokens 3]]"}]
    first = httpx.post(chat_url(server, sid), json={"messages": history})
    assert first.status_code == 200
    history += [first.json()["choices"][0]["message"], {"role": "user", "content": "second [[sim: tokens 3]]"}]
    before = httpx.get(f"{server}/sessions/{sid}").json()
    assert httpx.post(f"{engine}/sim/faults", json={fault: 1.0}).status_code == 200
    resp = httpx.post(chat_url(server, sid), json={"messages": history})
    assert resp.status_code == 502, resp.text
    assert resp.json()["error"]["type"] == "server_error"
    httpx.post(f"{engine}/sim/faults", json={})
    assert httpx.get(f"{server}/sessions/{sid}").json() == before
    assert httpx.post(chat_url(server, sid), json={"messages": history}).status_code == 200
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(engine)


def test_engine_500_passes_through(stack: dict[str, str], faults: None) -> None:
    server, engine = stack["server"], stack["engine"]
    sid = new_session(server)
    httpx.post(f"{engine}/sim/faults", json={"http_500": 1.0})
    resp = httpx.post(chat_url(server, sid), json=SHORT_CHAT)
    assert resp.status_code == 500
    httpx.post(f"{engine}/sim/faults", json={})
    assert httpx.get(f"{server}/sessions/{sid}").json()["records"] == []
    assert httpx.post(chat_url(server, sid), json=SHORT_CHAT).status_code == 200
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(engine)
