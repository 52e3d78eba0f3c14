"""Engine API keys (issue 9 point 7) and the cheap readiness probe (point 4), end to end.

The sim enforces SGLang's key rules (checked against SGLang's own `decide_request_auth` in
tests/unit/sglang_sim/test_auth.py): the api key on /generate and sessions, the admin key on abort and pause. A
recording proxy shows which engine paths the server called and with what result.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from harness.launchers import start_session_server
from support.server import chat_url, new_session
from support.sim import wait_for
from support.stack import Stack, StackFactory

FAMILY = "qwen3"
API_KEY = "k-api-7f3a"
ADMIN_KEY = "k-admin-91c2"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
NORMAL = {"Authorization": f"Bearer {API_KEY}"}
# 100 s at the engine: the agent goes away long before its end, however slow the machine
LONG_CHAT = {"messages": [{"role": "user", "content": "slow [[sim: tokens 20000]]"}], "max_tokens": 20000}


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(
        family=FAMILY,
        sim_args=["--api-key", API_KEY, "--admin-api-key", ADMIN_KEY, "--token-latency-ms", "5",
                  "--enable-streaming-session"],
        servers={"keyed": ["--engine-api-key", API_KEY, "--engine-admin-api-key", ADMIN_KEY, "--engine-sessions"],
                 "nokey": []},
        proxied={"keyed"},
    ) as stack:
        yield stack


def _info(engine: str) -> dict:
    r = httpx.get(f"{engine}/server_info", headers=NORMAL, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


async def _wait_engine(engine: str, predicate, within: float = 60.0) -> dict:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(within):
        while True:
            if predicate(info := _info(engine)):
                return info
            await asyncio.sleep(0.02)


def test_sim_enforces_keys(stack: Stack) -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(f"{stack.engine}/generate", json=body).status_code == 401
    assert httpx.post(f"{stack.engine}/generate", json=body, headers=ADMIN).status_code == 401
    assert httpx.post(f"{stack.engine}/generate", json=body, headers=NORMAL).status_code == 200
    assert httpx.post(f"{stack.engine}/abort_request", json={"rid": "x"}, headers=NORMAL).status_code == 401
    assert httpx.post(f"{stack.engine}/abort_request", json={"rid": "x"}, headers=ADMIN).status_code == 200
    assert httpx.get(f"{stack.engine}/ready").status_code == 200  # probes need no key


def test_keyed_server_chats_with_engine_sessions_and_aborts_on_disconnect(stack: Stack) -> None:
    server = stack["keyed"]
    assert stack.proxy is not None
    stack.proxy.clear()
    sid = new_session(server)
    messages = [{"role": "user", "content": "hi [[sim: tokens 5]]"}]
    r1 = httpx.post(chat_url(server, sid), json={"messages": messages}, timeout=30)
    assert r1.status_code == 200, r1.text
    messages += [r1.json()["choices"][0]["message"], {"role": "user", "content": "again [[sim: tokens 5]]"}]
    r2 = httpx.post(chat_url(server, sid), json={"messages": messages}, timeout=30)
    assert r2.status_code == 200, r2.text

    long_sid = new_session(server)

    async def disconnect() -> None:
        async with httpx.AsyncClient(timeout=30) as http:
            task = asyncio.ensure_future(http.post(chat_url(server, long_sid), json=LONG_CHAT))
            await _wait_engine(stack.engine, lambda i: i["running_requests"] == 1)
            task.cancel()  # the agent goes away mid-generation
            with pytest.raises(asyncio.CancelledError):
                await task
        # The abort (admin key) lands at once: far sooner than the 100 s the reply would take.
        await _wait_engine(stack.engine, lambda i: i["running_requests"] == 0, within=20)

    asyncio.run(disconnect())
    calls = stack.proxy.settled()
    assert {"/open_session", "/generate", "/abort_request"} <= {c["path"] for c in calls}
    assert all(c["status"] == 200 for c in calls), calls
    for s in (sid, long_sid):
        assert httpx.delete(f"{server}/sessions/{s}", timeout=10).status_code == 204
    wait_for(lambda: _info(stack.engine)["open_sessions"] == 0, 60)  # the closes run after the DELETEs answered
    info = _info(stack.engine)
    assert info["open_sessions"] == 0 and info["running_requests"] == 0, info


def test_server_without_the_key_answers_502_not_the_engines_401(stack: Stack) -> None:
    sid = new_session(stack["nokey"])
    r = httpx.post(chat_url(stack["nokey"], sid), json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 502, r.text
    assert "--engine-api-key" in r.text
    assert httpx.get(f"{stack['nokey']}/sessions/{sid}", timeout=10).json()["records"] == []


def test_ready_probes_the_engines_cheap_ready_not_health(stack: Stack) -> None:
    """SGLang's GET /health runs a one-token generation (>= 1 s); /ready is the probe (503 while paused)."""
    server = stack["keyed"]
    assert stack.proxy is not None
    stack.proxy.clear()
    assert httpx.get(f"{server}/ready", timeout=10).status_code == 200
    assert [c["path"] for c in stack.proxy.calls] == ["/ready"]
    assert httpx.post(f"{stack.engine}/pause_generation", json={"mode": "abort"}, headers=ADMIN).status_code == 200
    try:
        assert httpx.get(f"{server}/ready", timeout=10).status_code == 503
    finally:
        assert httpx.post(f"{stack.engine}/continue_generation", json={}, headers=ADMIN).status_code == 200
    assert httpx.get(f"{server}/ready", timeout=10).status_code == 200


def test_keys_from_the_environment_are_used_and_never_logged(stack: Stack) -> None:
    env = {"SESSION_SERVER_ENGINE_API_KEY": API_KEY, "SESSION_SERVER_ENGINE_ADMIN_API_KEY": ADMIN_KEY}
    with start_session_server(stack.engine, stack.tok, FAMILY, "--log-level", "debug", env=env,
                              log_dir=stack.logs) as proc:
        sid = new_session(proc.url)
        r = httpx.post(chat_url(proc.url, sid), json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert r.status_code == 200, r.text
        assert httpx.delete(f"{proc.url}/sessions/{sid}", timeout=10).status_code == 204
    output = "\n".join(proc.output)
    assert API_KEY not in output and ADMIN_KEY not in output
