"""Helpers shared by the session-server suites (tests/test_server_*.py): engine books, sessions, openai clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from sglang_sim.baseline import baseline_problems, engine_idle
from trajectory import samples_from_json

if TYPE_CHECKING:  # the SDK costs ~1 s to import: every test process loads this module (conftest), few use it
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
    return httpx.get(f"{engine}/server_info", timeout=60).json()


def wait_engine_idle(engine: str, timeout: float = 60.0) -> dict[str, Any]:
    """Poll until the engine runs and queues nothing; return its server_info. The default bound only turns a hang into
    a failure; a test that tells an aborted request from a finished one counts the engine's aborts instead."""
    deadline = time.monotonic() + timeout
    while True:
        info = engine_info(engine)
        if engine_idle(info):
            return info
        assert time.monotonic() < deadline, f"engine not idle: {info}"
        time.sleep(0.02)


def wait_engine_sessions(engine: str, open_sessions: int = 0, timeout: float = 60.0) -> dict[str, Any]:
    """Poll until the engine is idle and holds `open_sessions` engine sessions (DELETE closes them in the background);
    return its server_info, as it is at the bound if it never gets there (the caller's check then fails)."""
    deadline = time.monotonic() + timeout
    while True:
        info = wait_engine_idle(engine, timeout)
        if info["open_sessions"] == open_sessions or time.monotonic() > deadline:
            return info
        time.sleep(0.02)


def wait_emitted(engine: str, at_least: int = 1, timeout: float = 60.0) -> None:
    """Poll until the engine's live requests have emitted `at_least` tokens: a test that needs some tokens generated
    before it acts waits for them instead of sleeping a guess (a starved engine emits later, never sooner)."""
    deadline = time.monotonic() + timeout
    while engine_info(engine)["output_tokens_in_flight"] < at_least:
        assert time.monotonic() < deadline, f"the engine never emitted {at_least} tokens: {engine_info(engine)}"
        time.sleep(0.01)


def assert_engine_baseline(engine: str, *, open_sessions: int = 0) -> None:
    """Nothing runs, no session is held, and after a cache flush no KV slot is in use; the books balance
    (sglang_sim.baseline). A DELETE closes its engine session in the background (engine/sessions.py `retire`): the
    count is waited for, bounded, before it is checked."""
    idle = wait_engine_sessions(engine, open_sessions)
    flushed = httpx.post(f"{engine}/flush_cache", timeout=60)
    books = httpx.get(f"{engine}/sim/books", timeout=60).json()
    problems = baseline_problems(idle, flushed.status_code, engine_info(engine), books, open_sessions=open_sessions)
    assert not problems, problems


def metric(server: str, name: str, default: float | None = None) -> float:
    """One value of the server's /metrics (`name` as exposed, labels included, e.g. `x_total{reason="retry"}`);
    `default` for a series that does not exist (yet: a labelled counter appears at its first increment), else an
    AssertionError."""
    for line in httpx.get(f"{server}/metrics", timeout=60).text.splitlines():
        if line.startswith(name + " "):
            return float(line[len(name):].split()[0])
    if default is not None:
        return default
    raise AssertionError(f"{name} missing from /metrics")


def new_session(server: str, metadata: dict[str, Any] | None = None) -> str:
    body = {"metadata": metadata} if metadata is not None else None
    resp = httpx.post(f"{server}/sessions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()["session_id"]


def session_client(server: str, session_id: str, **kw: Any) -> openai.AsyncOpenAI:
    """The official SDK on a session's base URL; no retries, so a 409/503 surfaces instead of being retried."""
    import openai

    return openai.AsyncOpenAI(base_url=f"{server}/sessions/{session_id}/v1", api_key="x", max_retries=0, **kw)


SessionBody = Callable[[str, str, "openai.AsyncOpenAI", httpx.AsyncClient], Awaitable[None]]


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


def chat_content(server: str, session_id: str, body: dict[str, Any]) -> str:
    """One Chat Completions turn (`body["stream"]`: read as the SSE deltas it streams): the reply's content."""
    if body.get("stream"):
        with httpx.stream("POST", chat_url(server, session_id), json=body, timeout=120) as r:
            assert r.status_code == 200
            chunks = [json.loads(line[5:]) for line in r.iter_lines()
                      if line.startswith("data:") and line.strip() != "data: [DONE]"]
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    r = httpx.post(chat_url(server, session_id), json=body, timeout=120)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"] or "")


def assert_sample_is_what_the_engine_saw(sample: Any, calls: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """The merged sample against the recording proxy's /generate calls, in order: each prompt is a prefix of the
    sample and extends the previous prompt + completion (TITO: history is never re-tokenized), the completions and
    their logprobs are the engine's own, the loss mask is 1 exactly on them (logprobs 0 elsewhere) and the sample ends
    with the last one. A completion's stop token that the next prompt writes otherwise (harmony's `<|return|>`, written
    `<|end|>` in history) is that prompt's token in the sample, under mask 0. Returns each call's completion span
    (start, end) for the caller's per-turn checks."""
    tokens, mask, logprobs = sample.tokens, sample.loss_mask, sample.rollout_log_probs
    expected_mask = np.zeros(len(tokens), dtype=np.uint8)
    spans: list[tuple[int, int]] = []
    prev_end = 0
    for i, call in enumerate(calls):
        req, resp = call["request"], call["response"]
        input_ids = np.asarray(req["input_ids"], dtype=np.int32)
        output_ids = np.asarray(resp["output_ids"], dtype=np.int32)
        engine_logprobs = np.asarray([e[0] for e in resp["meta_info"]["output_token_logprobs"]], dtype=np.float32)
        start, end = len(input_ids), len(input_ids) + len(output_ids)
        assert start >= prev_end
        np.testing.assert_array_equal(tokens[:start], input_ids)
        following = calls[i + 1]["request"]["input_ids"] if i + 1 < len(calls) else None
        kept = end - int(following is not None and end > start and following[end - 1] != output_ids[-1])
        np.testing.assert_array_equal(tokens[start:kept], output_ids[:kept - start])
        np.testing.assert_array_equal(logprobs[start:kept], engine_logprobs[:kept - start])
        expected_mask[start:kept] = 1
        spans.append((start, end))
        prev_end = end
    assert prev_end == len(tokens)
    np.testing.assert_array_equal(mask, expected_mask)
    assert np.all(logprobs[mask == 0] == 0.0)
    return spans


def assert_training_data(stack: Any, sid: str, model_calls: int, streamed: bool = False) -> dict[str, Any]:
    """One committed turn per model call, no rollback, mask exactly the sampled tokens, tokens and logprobs equal to
    what the engine received and generated (the recording proxy's view; `stack` is a support.stack.Stack whose
    server is proxied). `streamed`: the agent streamed, so the engine must have streamed too (stream: true on
    /generate, SSE chunks as it generated)."""
    server, proxy = stack.server, stack.proxy
    assert proxy is not None
    info = httpx.get(f"{server}/sessions/{sid}", timeout=30).json()
    assert len(info["records"]) == model_calls, [r["message"] for r in info["records"]]
    assert info["rollbacks"] == 0 and all(r["rolled_back"] == 0 for r in info["records"])
    calls = [c for c in proxy.generates() if c["routing_key"] == sid]
    assert len(calls) == model_calls  # every model call reached the engine exactly once
    sample = samples_from_json(httpx.post(f"{server}/sessions/{sid}/samples", json={}, timeout=30).json())[0]
    for call in calls:
        assert call["status"] == 200 and call["response"] is not None
        assert call["request"]["stream"] is streamed
        if streamed:
            assert call["stream_chunks"] >= 2  # deltas as the engine produced them, not one chunk at the end
    spans = assert_sample_is_what_the_engine_saw(sample, calls)
    assert [(r["prompt_len"], r["completion_len"]) for r in info["records"]] == [(a, b - a) for a, b in spans]
    assert sample.metadata["rollbacks"] == 0
    return info


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


_PROBES = frozenset({"/health", "/ready", "/server_info", "/v1/loads", "/get_load"})


class RecordingProxy:
    """A loopback HTTP proxy in front of the engine that records every call, so tests can compare what the
    session server stored with what the engine actually received and generated (and in which order).

    `refuse[path] = status` answers calls to `path` with that status instead of forwarding them, and `delay[path] =
    seconds` forwards them that much later: an engine whose control calls fail or lag under load.

    `pass_disconnects`: a caller that goes away before a plain (unstreamed) answer closes the engine's connection too,
    as it would without the proxy (the call is then recorded with `disconnected: True` and no response); by default
    the proxy waits for the engine's answer and records it."""

    def __init__(self, target: str, *, pass_disconnects: bool = False) -> None:
        import socket
        import threading

        import msgspec
        import uvicorn
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import Response, StreamingResponse
        from starlette.routing import Route

        self.target = target
        self.calls: list[dict[str, Any]] = []
        self.refuse: dict[str, int] = {}
        self.delay: dict[str, float] = {}
        client = httpx.AsyncClient(base_url=target, timeout=120)

        async def forward(request: Request) -> Response:
            body = await request.body()
            entry: dict[str, Any] = {
                "path": request.url.path, "started": time.monotonic(),
                "routing_key": request.headers.get("x-smg-routing-key"),
                "traceparent": request.headers.get("traceparent"),  # the turn span's, with --otlp-endpoint
            }
            if body:
                entry["request"] = msgspec.json.decode(body)
            self.calls.append(entry)
            path = request.url.path
            if path in self.delay:
                await asyncio.sleep(self.delay[path])
            if path in self.refuse:
                entry.update(status=self.refuse[path], finished=time.monotonic(), response=None)
                return Response(b'{"error": {"message": "refused by the test proxy"}}', status_code=self.refuse[path],
                                media_type="application/json")
            forwarded = ("content-type", "x-smg-routing-key", "authorization", "traceparent", "tracestate")
            headers = {k: v for k, v in request.headers.items() if k.lower() in forwarded}
            send = client.send(client.build_request(request.method, path, content=body, headers=headers), stream=True)
            if pass_disconnects:
                upstream = await until_disconnect(request, send)
                if upstream is None:
                    entry.update(disconnected=True, finished=time.monotonic(), response=None, status=499)
                    return Response(status_code=499)
            else:
                upstream = await send
            media_type = upstream.headers.get("content-type")
            if media_type and media_type.startswith("text/event-stream"):  # relayed as it comes, recorded at its end
                return StreamingResponse(relay(upstream, entry), upstream.status_code, media_type=media_type)
            content = await upstream.aread()
            await upstream.aclose()
            try:
                entry["response"] = msgspec.json.decode(content)
            except msgspec.DecodeError:
                entry["response"] = None
            entry.update(finished=time.monotonic(), status=upstream.status_code)  # `status` last: `settled` reads it
            return Response(content, status_code=upstream.status_code, media_type=media_type)

        async def until_disconnect(request: Request, send: Any) -> httpx.Response | None:
            """The engine's answer (headers and, unless streamed, its whole body), or None when the caller went away
            first: the engine's request is then cancelled, which closes its connection."""

            async def disconnected() -> None:
                while (await request.receive())["type"] != "http.disconnect":
                    pass

            async def answer() -> httpx.Response:
                upstream: httpx.Response = await send
                if not (upstream.headers.get("content-type") or "").startswith("text/event-stream"):
                    await upstream.aread()
                return upstream

            call, gone = asyncio.ensure_future(answer()), asyncio.ensure_future(disconnected())
            await asyncio.wait((call, gone), return_when=asyncio.FIRST_COMPLETED)
            for task in (call, gone):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await gone
            try:
                return await call
            except asyncio.CancelledError:
                return None

        async def relay(upstream: httpx.Response, entry: dict[str, Any]) -> AsyncIterator[bytes]:
            """Pass a stream (SGLang's cumulative chunks) through piece by piece; the last event is the whole
            response. A reader that goes away closes the engine's stream too, as it would without the proxy."""
            received = bytearray()
            try:
                async for piece in upstream.aiter_raw():
                    received += piece
                    yield piece
            finally:
                events = sse_events(bytes(received[: received.rfind(b"\n\n") + 1]))  # whole events only
                entry.update(stream_chunks=len(events), response=events[-1] if events else None,
                             finished=time.monotonic(), status=upstream.status_code)
                await upstream.aclose()

        app = Starlette(routes=[Route("/{path:path}", forward, methods=["GET", "POST"])])
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            assert time.monotonic() < deadline, "recording proxy did not start"
            time.sleep(0.01)

    def generates(self) -> list[dict[str, Any]]:
        return [c for c in self.calls if c["path"] == "/generate"]

    def paths(self) -> list[str]:
        """The calls a test makes happen, without the server's own background probes (readiness, load, info), which
        land whenever their timers fire."""
        return [c["path"] for c in self.calls if c["path"].split("?")[0] not in _PROBES]

    def clear(self) -> None:
        self.calls.clear()

    def settled(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """The calls once each has its answer: the engine may end a request (an abort) a moment before its answer
        has passed the proxy and been recorded."""
        deadline = time.monotonic() + timeout
        while pending := [c for c in self.calls if "status" not in c]:
            assert time.monotonic() < deadline, f"calls still unanswered after {timeout}s: {pending}"
            time.sleep(0.01)
        return list(self.calls)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(60)


async def wait_running(engine: str, n: int = 1) -> None:
    """Wait until the engine runs at least `n` requests: the chats under test are parked there. The bound (60 s) only
    turns a hang into a failure: a loaded machine may take seconds to get the chats there."""
    async with httpx.AsyncClient(timeout=60) as http, asyncio.timeout(60):
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
