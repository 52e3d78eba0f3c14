"""Housekeeping and guards: the idle-session sweep, bounded tombstones, the admin token, 404-before-400 ordering on
the session routes, and inspection (GET, samples) built on the CPU pool rather than on the event loop.

One `sglang-sim` with streaming sessions and a `session-server` with `--engine-sessions`, a 3 s idle timeout, an
admin token and room for two tombstones; a second one ("stuck") with a 1 s idle timeout and a 3 s request timeout for
the chat whose body never arrives. Idle-expiry waits are bounded by polling /metrics (a GET would count as activity);
every scenario ends with the engine at its baseline, which proves that an expired session's engine session was closed.

No verdict depends on the machine's speed (issue 30): what must stay alive is used again within a small fraction of
the idle timeout (ACTIVE_GAP, an order of magnitude below it), what must expire is silent for longer than the timeout
plus a sweep by construction (sleeps and replies are never shorter than asked), and a chat that must outlast the idle
timeout runs far within the request timeout.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from urllib.parse import urlsplit

import httpx
import pytest

from session_server.api import admin
from session_server.errors import SessionNotFoundError
from session_server.sessions.registry import Registry
from session_server.sessions.sweeper import idle_sessions
from support.server import assert_engine_baseline, chat_url, metric, new_session
from support.stack import Stack, StackFactory

FAMILY = "qwen3"
TOKEN_MS = 10
IDLE = 3.0  # the server's idle timeout; its sweep runs every IDLE / 10
ACTIVE_GAP = 0.1  # the pause between requests that keep a session alive: with a request's own time, well under IDLE
STUCK_IDLE = 1.0  # the "stuck" server's idle timeout and request timeout
STUCK_REQUEST_TIMEOUT = 3.0
WAIT = 60.0  # a bound on waiting for an event, never a measure of speed
TOMBSTONES = 2
TOKEN = "s3cret"
SHORT_CHAT = {"messages": [{"role": "user", "content": "quick [[sim: tokens 3]]"}]}


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory) -> Iterator[Stack]:
    with stack_factory(
        family=FAMILY,
        sim_args=["--enable-streaming-session", "--token-latency-ms", str(TOKEN_MS)],
        servers={"server": [
            "--engine-sessions", "--session-idle-timeout", str(IDLE), "--admin-token", TOKEN,
            "--tombstones", str(TOMBSTONES),
        ], "stuck": ["--session-idle-timeout", str(STUCK_IDLE), "--request-timeout", str(STUCK_REQUEST_TIMEOUT)]},
    ) as stack:
        yield stack


def _wait_metric(server: str, name: str, value: float, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while metric(server, name) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}: {metric(server, name)}"
        time.sleep(0.05)


def _error(resp: httpx.Response) -> str:
    return resp.json()["error"]["message"]


# -- idle sweep ------------------------------------------------------------------------------------------------
def test_idle_session_expires_exactly_like_delete(stack: dict[str, str]) -> None:
    server, engine = stack["server"], stack["engine"]
    expired = metric(server, "session_server_sessions_expired_total")
    deleted = metric(server, "session_server_sessions_deleted_total")
    sid = new_session(server)
    first = httpx.post(chat_url(server, sid), json=SHORT_CHAT)
    assert first.status_code == 200
    history = [*SHORT_CHAT["messages"], first.json()["choices"][0]["message"], *SHORT_CHAT["messages"]]
    assert httpx.post(chat_url(server, sid), json={"messages": history}).status_code == 200  # opens its engine session
    last_use = time.monotonic()
    assert_engine_baseline(engine, open_sessions=1)  # the trajectory's engine session holds its KV
    _wait_metric(server, "session_server_sessions_expired_total", expired + 1, timeout=IDLE + WAIT)
    assert time.monotonic() - last_use >= IDLE  # never before the timeout
    assert metric(server, "session_server_sessions_deleted_total") == deleted  # counted apart from DELETEs
    for resp in (
        httpx.get(f"{server}/sessions/{sid}"),
        httpx.post(f"{server}/sessions/{sid}/samples"),
        httpx.post(chat_url(server, sid), json=SHORT_CHAT),
        httpx.delete(f"{server}/sessions/{sid}"),
    ):
        assert resp.status_code == 404 and "expired" in _error(resp), resp.text
    assert_engine_baseline(engine)  # the engine session was closed


def test_requests_keep_a_session_alive(stack: dict[str, str]) -> None:
    server, engine = stack["server"], stack["engine"]
    sid = new_session(server)
    assert httpx.post(chat_url(server, sid), json=SHORT_CHAT).status_code == 200
    until = time.monotonic() + 2 * IDLE  # past the idle timeout and a sweep: a session that reads do not keep alive
    while time.monotonic() < until:  # only reads, each a small fraction of the idle timeout after the previous one
        assert httpx.get(f"{server}/sessions/{sid}").status_code == 200
        time.sleep(ACTIVE_GAP)
        assert httpx.post(f"{server}/sessions/{sid}/samples").status_code == 200
        time.sleep(ACTIVE_GAP)
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(engine)


def test_a_pause_is_not_idleness(stack: dict[str, str]) -> None:
    """Nothing expires while paused for a weight update, and continuing restarts every session's idle clock."""
    server, engine = stack["server"], stack["engine"]
    auth = {"Authorization": f"Bearer {TOKEN}"}
    expired = metric(server, "session_server_sessions_expired_total")
    sid = new_session(server)
    assert httpx.post(f"{server}/admin/pause", json={"mode": "drain"}, headers=auth).status_code == 200
    try:
        time.sleep(1.5 * IDLE)  # silent for well past the idle timeout and a sweep, but paused
        assert metric(server, "session_server_sessions_expired_total") == expired
    finally:
        assert httpx.post(f"{server}/admin/continue", headers=auth).status_code == 200
    # The clock restarted at continue: still alive a few sweeps later (without the restart, expired at the first).
    time.sleep(IDLE / 4)
    assert metric(server, "session_server_sessions_expired_total") == expired
    assert httpx.post(chat_url(server, sid), json=SHORT_CHAT).status_code == 200
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(engine)


def test_a_chat_in_flight_is_not_idle(stack: dict[str, str]) -> None:
    server, engine = stack["server"], stack["engine"]
    sid = new_session(server)
    tokens = int(2 * IDLE * 1000 / TOKEN_MS)  # well past the idle timeout at the engine, far within the request timeout
    long_chat = {"messages": [{"role": "user", "content": f"slow [[sim: tokens {tokens}]]"}], "max_tokens": tokens}
    started = time.monotonic()
    first = httpx.post(chat_url(server, sid), json=long_chat, timeout=30)
    assert first.status_code == 200, first.text
    assert time.monotonic() - started > 1.5 * IDLE
    # The end of the chat counts as activity too: a few sweeps later the session is still there.
    time.sleep(IDLE / 4)
    assert first.json()["usage"]["completion_tokens"] == tokens
    follow = [*long_chat["messages"], first.json()["choices"][0]["message"], SHORT_CHAT["messages"][0]]
    assert httpx.post(chat_url(server, sid), json={"messages": follow}).status_code == 200
    assert len(httpx.get(f"{server}/sessions/{sid}").json()["records"]) == 2
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(engine)


def test_a_chat_stuck_past_the_request_timeout_is_expired(stack: dict[str, str]) -> None:
    """A client that never finishes its body holds the slot; the sweep aborts it once it outlives the timeout."""
    server, engine = stack["stuck"], stack["engine"]
    expired = metric(server, "session_server_sessions_expired_total")
    sid = new_session(server)
    host, port = urlsplit(server).hostname, urlsplit(server).port
    started = time.monotonic()
    with socket.create_connection((host, port), timeout=STUCK_REQUEST_TIMEOUT + WAIT) as sock:
        head = (
            f"POST /sessions/{sid}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"messages\": ["
        )
        sock.sendall(head.encode())
        reply = sock.recv(65536)
    assert reply.startswith(b"HTTP/1.1 404"), reply[:300]
    assert time.monotonic() - started >= STUCK_REQUEST_TIMEOUT
    # The 404 goes out when the chat is aborted; the sweep counts the expiry once the session is forgotten, after it.
    _wait_metric(server, "session_server_sessions_expired_total", expired + 1, timeout=WAIT)
    _wait_metric(server, "session_server_in_flight", 0, timeout=WAIT)
    resp = httpx.get(f"{server}/sessions/{sid}")
    assert resp.status_code == 404 and "expired" in _error(resp)
    assert_engine_baseline(engine)


def test_idle_selection_rules() -> None:
    def session(last_active: float, claim_started: float | None = None, closing: bool = False) -> SimpleNamespace:
        claims = [] if claim_started is None else [SimpleNamespace(started=claim_started)]
        return SimpleNamespace(last_active=last_active, claims=claims, closing=closing)

    now = 1000.0
    fresh, idle, closing = session(now - 5), session(now - 11), session(now - 50, closing=True)
    busy, stuck = session(now - 50, claim_started=now - 50), session(now - 200, claim_started=now - 200)
    picked = idle_sessions([fresh, idle, closing, busy, stuck], now, idle_timeout=10, request_timeout=100)
    assert picked == [idle, stuck]


# -- tombstones ------------------------------------------------------------------------------------------------
def test_registry_keeps_a_bounded_number_of_tombstones() -> None:
    registry = Registry(max_tombstones=3)
    ids = [registry.create(object()).id for _ in range(5)]  # type: ignore[arg-type]
    for sid in ids:
        registry.forget(sid)
        registry.forget(sid)  # idempotent: no second tombstone
    registry.forget(ids[0], "expired after being idle")  # already forgotten: nothing changes
    assert len(registry) == 0 and registry.num_tombstones == 3
    assert [registry.is_tombstoned(sid) for sid in ids] == [False, False, True, True, True]  # oldest evicted first
    with pytest.raises(SessionNotFoundError, match="not found"):
        registry.require(ids[0])
    with pytest.raises(SessionNotFoundError, match="was deleted"):
        registry.require(ids[4])
    live = registry.create(object())  # type: ignore[arg-type]
    registry.forget(live.id, "expired after being idle")
    assert registry.num_tombstones == 3 and not registry.is_tombstoned(ids[2])
    with pytest.raises(SessionNotFoundError, match="expired"):
        registry.require(live.id)
    none_kept = Registry(max_tombstones=0)
    gone = none_kept.create(object()).id  # type: ignore[arg-type]
    none_kept.forget(gone)
    assert none_kept.num_tombstones == 0
    with pytest.raises(ValueError):
        Registry(max_tombstones=-1)


def test_registry_require_refuses_a_closing_session_and_marks_use() -> None:
    registry = Registry()
    session = registry.create(object())  # type: ignore[arg-type]
    session.last_active = 0.0
    assert registry.require(session.id) is session and session.last_active > 0
    session.closing = True
    with pytest.raises(SessionNotFoundError, match="being deleted"):
        registry.require(session.id)


def test_server_tombstones_are_bounded(stack: dict[str, str]) -> None:
    server = stack["server"]
    ids = [new_session(server) for _ in range(TOMBSTONES + 1)]
    for sid in ids:
        assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert metric(server, "session_server_tombstones") == TOMBSTONES
    oldest, newest = httpx.get(f"{server}/sessions/{ids[0]}"), httpx.get(f"{server}/sessions/{ids[-1]}")
    assert oldest.status_code == 404 and "not found" in _error(oldest)
    assert newest.status_code == 404 and "was deleted" in _error(newest)


# -- admin token -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "authorization", [None, "", "Bearer", "Bearer wrong", f"bearer {TOKEN}", TOKEN, f"Bearer  {TOKEN}",
                      f"Basic {TOKEN}", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}"]
)
def test_admin_routes_refuse_a_missing_or_wrong_token(stack: dict[str, str], authorization: str | None) -> None:
    server = stack["server"]
    headers = {} if authorization is None else {"Authorization": authorization}
    for path in ("/admin/pause", "/admin/continue"):
        resp = httpx.post(f"{server}{path}", json={"mode": "abort"}, headers=headers)
        assert resp.status_code == 401, (path, resp.text)
        assert resp.json()["error"]["code"] == 401
    assert metric(server, "session_server_paused") == 0  # a refused pause changed nothing


def test_admin_routes_accept_the_right_token(stack: dict[str, str]) -> None:
    server = stack["server"]
    good = {"Authorization": f"Bearer {TOKEN}"}
    sid = new_session(server)
    assert httpx.post(f"{server}/admin/pause", json={"mode": "drain"}, headers=good).status_code == 200
    assert metric(server, "session_server_paused") == 1
    assert httpx.post(chat_url(server, sid), json=SHORT_CHAT).status_code == 503
    assert httpx.post(f"{server}/admin/continue", headers={"Authorization": "Bearer no"}).status_code == 401
    assert metric(server, "session_server_paused") == 1  # a refused continue changed nothing
    assert httpx.post(f"{server}/admin/continue", headers=good).status_code == 200
    assert metric(server, "session_server_paused") == 0
    assert httpx.post(chat_url(server, sid), json=SHORT_CHAT).status_code == 200
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    assert_engine_baseline(stack["engine"])


def test_admin_token_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decision is hmac.compare_digest's alone: a spy that inverts it inverts the outcome."""
    from starlette.requests import Request

    calls: list[tuple[bytes, bytes]] = []
    verdict = {"value": False}

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return verdict["value"]

    monkeypatch.setattr(admin.hmac, "compare_digest", spy)
    app = SimpleNamespace(state=SimpleNamespace(server=SimpleNamespace(config=SimpleNamespace(admin_token=TOKEN))))

    def request(authorization: str) -> Request:
        return Request({"type": "http", "app": app, "headers": [(b"authorization", authorization.encode())]})

    with pytest.raises(admin.AdminAuthError):
        admin.authorize(request(f"Bearer {TOKEN}"))  # the right token, but compare_digest says no
    verdict["value"] = True
    admin.authorize(request("Bearer wrong"))  # a wrong token, but compare_digest says yes
    assert calls == [(f"Bearer {TOKEN}".encode(), f"Bearer {TOKEN}".encode()),
                     (b"Bearer wrong", f"Bearer {TOKEN}".encode())]


# -- 404 before 400 on the session routes (docs/design.md 3) ----------------------------------------------------------
BAD_SAMPLES_BODIES = {
    "not_json": b"{max_seq_len: 8",
    "not_object": b"[8]",
    "zero": b'{"max_seq_len": 0}',
    "negative": b'{"max_seq_len": -4}',
    "float": b'{"max_seq_len": 8.0}',
    "string": b'{"max_seq_len": "8"}',
    "bool": b'{"max_seq_len": true}',
    "list": b'{"max_seq_len": [8]}',
}


@pytest.mark.parametrize("case", sorted(BAD_SAMPLES_BODIES))
def test_samples_order_404_then_400(stack: dict[str, str], case: str) -> None:
    server, body = stack["server"], BAD_SAMPLES_BODIES[case]
    headers = {"content-type": "application/json"}
    unknown = httpx.post(f"{server}/sessions/{'cd' * 16}/samples", content=body, headers=headers)
    assert unknown.status_code == 404 and "not found" in _error(unknown)
    sid = new_session(server)
    assert httpx.post(chat_url(server, sid), json=SHORT_CHAT).status_code == 200
    resp = httpx.post(f"{server}/sessions/{sid}/samples", content=body, headers=headers)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == 400, resp.text
    if case not in ("not_json", "not_object"):
        assert "max_seq_len" in _error(resp)
    ok = httpx.post(f"{server}/sessions/{sid}/samples", json={"max_seq_len": 8})
    assert ok.status_code == 200 and len(ok.json()[0]["tokens"]) == 8  # the session is unharmed
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204
    deleted = httpx.post(f"{server}/sessions/{sid}/samples", content=body, headers=headers)
    assert deleted.status_code == 404 and "was deleted" in _error(deleted)
    got = httpx.get(f"{server}/sessions/{sid}")
    assert got.status_code == 404 and "was deleted" in _error(got)


def test_samples_without_max_seq_len_are_whole(stack: dict[str, str]) -> None:
    server = stack["server"]
    sid = new_session(server)
    assert httpx.post(f"{server}/sessions/{sid}/samples").json() == []  # before the first turn
    assert httpx.post(chat_url(server, sid), json=SHORT_CHAT).status_code == 200
    num_tokens = httpx.get(f"{server}/sessions/{sid}").json()["num_tokens"]
    for body in (b"", b"{}", b'{"max_seq_len": null}'):
        resp = httpx.post(f"{server}/sessions/{sid}/samples", content=body)
        assert resp.status_code == 200 and len(resp.json()[0]["tokens"]) == num_tokens, body
    assert httpx.delete(f"{server}/sessions/{sid}").status_code == 204


# -- inspection runs on the CPU pool ---------------------------------------------------------------------------
def test_get_and_samples_build_their_bodies_on_the_pool(stack: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process app against the real engine: the snapshot is taken on the loop, the re-render + diff and the
    serialization of GET and samples happen in the pool's threads."""
    from starlette.testclient import TestClient

    from session_server.api import samples as samples_module
    from session_server.api import sessions as sessions_module
    from session_server.app import build_app
    from session_server.cli import load_family
    from session_server.config import ServerConfig
    from session_server.turns import pipeline
    from trajectory import LinearTrajectory

    threads: dict[str, set[str]] = {}

    def spy(owner: object, name: str) -> None:
        original = getattr(owner, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            threads.setdefault(name, set()).add(threading.current_thread().name)
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)

    for name in ("snapshot", "to_dict", "mismatch_report"):
        spy(LinearTrajectory, name)
    spy(sessions_module, "_session_body")
    spy(samples_module, "_encode")
    spy(pipeline, "prepare_turn")

    config = ServerConfig(engine_url=stack["engine"], tokenizer=str(stack["tok"]), model_family=FAMILY, cpu_workers=2)
    app = build_app(config, load_family(stack["tok"], FAMILY))
    with TestClient(app) as client:
        loop_thread = client.portal.call(lambda: threading.current_thread().name)
        sid = client.post("/sessions").json()["session_id"]
        first = client.post(f"/sessions/{sid}/v1/chat/completions", json=SHORT_CHAT)
        assert first.status_code == 200
        # A first turn renders and tokenizes its whole body: a short one inline (cheaper than a hop)...
        assert threads.pop("prepare_turn") == {loop_thread}
        tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "d" * 200,
                                                   "parameters": {"type": "object", "properties": {}}}}
                 for i in range(8)]
        tooled = client.post("/sessions").json()["session_id"]
        assert client.post(f"/sessions/{tooled}/v1/chat/completions",
                           json={**SHORT_CHAT, "tools": tools}).status_code == 200
        # ...one with a few tool schemas (about 2 KiB to render) on the pool.
        assert all(t.startswith("session-cpu") for t in threads.pop("prepare_turn"))
        assert client.delete(f"/sessions/{tooled}").status_code == 204
        history = [*SHORT_CHAT["messages"], first.json()["choices"][0]["message"], {"role": "user", "content": "more"}]
        assert client.post(f"/sessions/{sid}/v1/chat/completions",
                           json={**SHORT_CHAT, "messages": history}).status_code == 200
        assert threads.pop("prepare_turn") == {loop_thread}  # a small appended turn is cheaper inline than a hop
        big = client.post("/sessions").json()["session_id"]
        long_chat = {**SHORT_CHAT, "messages": [{"role": "user", "content": "x" * 70_000}]}
        assert client.post(f"/sessions/{big}/v1/chat/completions", json=long_chat).status_code == 200
        assert all(t.startswith("session-cpu") for t in threads.pop("prepare_turn"))  # a large one is pooled
        assert client.delete(f"/sessions/{big}").status_code == 204
        threads.clear()
        info = client.get(f"/sessions/{sid}")
        assert info.status_code == 200 and info.json()["mismatch_report"]["assistant_only"], info.text
        assert client.post(f"/sessions/{sid}/samples", json={"max_seq_len": 4}).status_code == 200
        assert client.delete(f"/sessions/{sid}").status_code == 204
    assert threads["snapshot"] == {loop_thread}  # consistent: taken on the loop, under the session lock
    for name in ("_session_body", "to_dict", "mismatch_report", "_encode"):
        assert threads[name] and all(t.startswith("session-cpu") for t in threads[name]), (name, threads)
    assert_engine_baseline(stack["engine"])
