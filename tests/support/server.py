"""Helpers shared by the session-server suites (tests/test_server_*.py): engine books, sessions, openai clients."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def engine_info(engine: str) -> dict[str, Any]:
    return httpx.get(f"{engine}/server_info", timeout=10).json()


def wait_engine_idle(engine: str, timeout: float = 10.0) -> dict[str, Any]:
    """Poll until the engine runs and queues nothing; return its server_info."""
    deadline = time.monotonic() + timeout
    while True:
        info = engine_info(engine)
        if info["running_requests"] == 0 and info["waiting_requests"] == 0:
            return info
        assert time.monotonic() < deadline, f"engine not idle: {info}"
        time.sleep(0.02)


def assert_engine_baseline(engine: str, *, open_sessions: int = 0) -> None:
    """Nothing runs, no session is held, and after a cache flush no KV slot is in use; the books balance."""
    info = wait_engine_idle(engine)
    assert info["open_sessions"] == open_sessions, info
    flushed = httpx.post(f"{engine}/flush_cache", timeout=10)
    assert flushed.status_code == 200, flushed.text
    info = engine_info(engine)
    if open_sessions == 0:
        assert info["kv_used_tokens"] == 0, info
    books = httpx.get(f"{engine}/sim/books", timeout=10).json()
    assert books["ok"], books


def new_session(server: str, metadata: dict[str, Any] | None = None) -> str:
    body = {"metadata": metadata} if metadata is not None else None
    resp = httpx.post(f"{server}/sessions", json=body, timeout=10)
    assert resp.status_code == 200, resp.text
    return resp.json()["session_id"]


def session_client(server: str, session_id: str, **kw: Any) -> openai.AsyncOpenAI:
    """The official SDK on a session's base URL; no retries, so a 409/503 surfaces instead of being retried."""
    return openai.AsyncOpenAI(base_url=f"{server}/sessions/{session_id}/v1", api_key="x", max_retries=0, **kw)


SessionBody = Callable[[str, str, openai.AsyncOpenAI, httpx.AsyncClient], Awaitable[None]]


def run_in_session(server: str, body: SessionBody, metadata: dict[str, Any] | None = None) -> None:
    """`asyncio.run(body(server, sid, client, http))` on a new session of `server`: `client` is the SDK on the
    session's base URL (`session_client`), `http` a plain async client; both are closed afterwards."""

    async def main() -> None:
        sid = new_session(server, metadata)
        async with httpx.AsyncClient(timeout=30) as http, session_client(server, sid) as client:
            await body(server, sid, client, http)

    asyncio.run(main())


def chat_url(server: str, session_id: str) -> str:
    return f"{server}/sessions/{session_id}/v1/chat/completions"


def as_history(message: Any) -> dict[str, Any]:
    """An SDK reply message as an agent appends it to its history (reasoning_content included)."""
    return message.model_dump(exclude_none=True)


def sse_events(body: bytes) -> list[Any]:
    """The JSON payloads of an SSE body (`data: {...}` events), `[DONE]` left out."""
    import msgspec

    events = []
    for block in body.split(b"\n\n"):
        data = block.strip()
        if data.startswith(b"data:") and data[5:].strip() != b"[DONE]":
            events.append(msgspec.json.decode(data[5:].strip()))
    return events


class RecordingProxy:
    """A loopback HTTP proxy in front of the engine that records every call, so tests can compare what the
    session server stored with what the engine actually received and generated (and in which order)."""

    def __init__(self, target: str) -> None:
        import socket
        import threading

        import msgspec
        import uvicorn
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response
        from starlette.routing import Route

        self.target = target
        self.calls: list[dict[str, Any]] = []
        client = httpx.AsyncClient(base_url=target, timeout=120)

        async def forward(request: Request) -> Response:
            body = await request.body()
            entry: dict[str, Any] = {
                "path": request.url.path, "started": time.monotonic(),
                "routing_key": request.headers.get("x-smg-routing-key"),
            }
            if body:
                entry["request"] = msgspec.json.decode(body)
            self.calls.append(entry)
            forwarded = ("content-type", "x-smg-routing-key", "authorization")
            headers = {k: v for k, v in request.headers.items() if k.lower() in forwarded}
            resp = await client.request(request.method, request.url.path, content=body, headers=headers)
            entry["status"] = resp.status_code
            entry["finished"] = time.monotonic()
            try:
                entry["response"] = msgspec.json.decode(resp.content)
            except msgspec.DecodeError:
                entry["response"] = None
                if resp.content.startswith(b"data:"):  # a streamed /generate: SGLang's chunks are cumulative,
                    events = sse_events(resp.content)    # so the last one is the whole response
                    entry["stream_chunks"] = len(events)
                    entry["response"] = events[-1] if events else None
            return Response(resp.content, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

        app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            assert time.monotonic() < deadline, "recording proxy did not start"
            time.sleep(0.01)

    def generates(self) -> list[dict[str, Any]]:
        return [c for c in self.calls if c["path"] == "/generate"]

    def paths(self) -> list[str]:
        return [c["path"] for c in self.calls if c["path"] not in ("/health", "/server_info")]

    def clear(self) -> None:
        self.calls.clear()

    def settled(self, timeout: float = 10.0) -> list[dict[str, Any]]:
        """The calls once each has its answer: the engine may end a request (an abort) a moment before its answer
        has passed the proxy and been recorded."""
        deadline = time.monotonic() + timeout
        while pending := [c for c in self.calls if "status" not in c]:
            assert time.monotonic() < deadline, f"calls still unanswered after {timeout}s: {pending}"
            time.sleep(0.01)
        return list(self.calls)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)


async def wait_running(engine: str, n: int = 1) -> None:
    """Wait (at most 10 s) until the engine runs at least `n` requests: the chats under test are parked there."""
    async with httpx.AsyncClient() as http, asyncio.timeout(10):
        while True:
            if (await http.get(f"{engine}/server_info")).json()["running_requests"] >= n:
                return
            await asyncio.sleep(0.01)


def start_parallel(*launches: Any) -> list[Any]:
    """Start several children at once (loading tokenizers is the slow part of a launch), then wait for each.

    Each launch is a callable taking `wait=False` (e.g. a functools.partial of start_session_server). The children
    are spawned from this thread: the launcher ties a child's life to the thread that forked it (PDEATHSIG), so
    they must not be spawned from short-lived pool threads. If one fails, all are stopped.
    """
    procs = [launch(wait=False) for launch in launches]
    try:
        for proc in procs:
            proc.wait_ready()
    except BaseException:
        for proc in procs:
            proc.stop()
        raise
    return procs
