"""The one HTTP client to the engine (SGLang's native API, docs/design.md 5.1).

Two pools for the whole process, both lean keep-alive HTTP/1.1 (engine/http11.py): the hot POST /generate (up to
ServerConfig.engine_connections sockets), and the control calls (abort, open/close session, ready, models; up to
CONTROL_CONNECTIONS), so an abort never queues behind a saturated generate pool. The control pool is sized for a
GRPO step's burst (hundreds of opens, then as many closes and aborts at once) and every connection it opens is kept
alive: it was an httpx pool of 32 connections that kept 8, and under such a burst it was the queue (http11.py says
how it broke). Transport failures become 502
(EngineUnavailableError); the engine's own non-2xx answers are returned as they are, so the chat handler can pass them
through unrecorded. Client headers are never forwarded; we add only the sticky-routing key and the engine's key (and,
with --otlp-endpoint, the turn span's `traceparent`: session_server/tracing.py).

Control calls get a short deadline of their own (`control_timeout`, a second by default): they are what frees KV and
slots, and a stalled engine must never hold DELETE, /ready or a timed-out chat for longer than that.

Keys (SGLang's `--api-key` / `--admin-api-key`, see sglang/srt/utils/auth.py `decide_request_auth`): `/generate`,
`/open_session`, `/close_session`, `/v1/models` and `/server_info` are NORMAL endpoints and want the api key;
`/abort_request`, `/pause_generation`, `/continue_generation`, `/flush_cache`, `/update_weight_version` are
ADMIN_OPTIONAL and want the admin key when the engine has one (the api key is then refused), else the api key;
`/health*`, `/ready` and `/metrics` need no key. Keys are never logged (EngineClient's repr hides them).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

from session_server.engine.http11 import IDLE_LIMIT, EngineHTTP, EngineStream
from session_server.engine.routers import fan_out_path, unpack_fan_out
from session_server.errors import EngineUnavailableError
from session_server.tracing import engine_headers

logger = logging.getLogger("session_server.engine")

_json = msgspec.json.Encoder()
ROUTING_HEADER = "X-SMG-Routing-Key"
DEFAULT_CONTROL_TIMEOUT = 1.0
CONTROL_CONNECTIONS = 256  # control calls at once per engine; more wait for a free one, within their own deadline


@dataclass(slots=True)
class EngineReply:
    status: int
    body: bytes
    content_type: str

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


class Answer(enum.Enum):
    """How the engine took a control call, for whoever decides whether to try it again (engine/retries.py)."""

    DONE = "done"  # 2xx: the engine took it
    RETRY = "retry"  # no answer in time, a broken connection, or a passing refusal (5xx, 408, 429): try again later
    REFUSED = "refused"  # any other 4xx (e.g. a router's 404): no later try would land

    @classmethod
    def of(cls, status: int) -> Answer:
        if 200 <= status < 300:
            return cls.DONE
        return cls.RETRY if status >= 500 or status in (408, 429) else cls.REFUSED


ENGINE_CLIENTS = ("httptools", "httpx")
StreamedReply = httpx.Response | EngineStream  # status_code, headers, aiter_bytes(), aread()


class _HttpxGenerate:
    """The hot path on httpx instead of engine/http11.py (`--engine-client httpx`): same contract (a cancelled
    request closes its connection, transport failures are EngineUnavailableError, no resend), kept so the cost
    difference that justifies engine/http11.py can be re-measured (`make bench-compare`)."""

    def __init__(self, base_url: str, *, connections: int, connect_timeout: float) -> None:
        self._client = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(None, connect=connect_timeout),  # the chat handler owns the request deadline
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections,
                                keepalive_expiry=IDLE_LIMIT),
            transport=httpx.AsyncHTTPTransport(retries=0),
        )

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes, str]:
        try:
            resp = await self._client.post(path, content=body, headers={"Content-Type": "application/json", **headers})
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(f"engine POST {path} failed: {type(exc).__name__}: {exc}") from exc
        return resp.status_code, resp.content, resp.headers.get("content-type", "application/json")

    def close(self) -> None:
        pass  # the pool is released in aclose()

    async def aclose(self) -> None:
        await self._client.aclose()


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def _check_credentials(status: int) -> None:
    """A 401/403 on /generate is about the session server's key, not the agent's request: never pass it through
    as the agent's fault."""
    if status in (401, 403):
        raise EngineUnavailableError(
            f"engine refused the session server's credentials ({status}); check --engine-api-key")


class EngineClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout: float,
        connections: int,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        control_timeout: float = DEFAULT_CONTROL_TIMEOUT,
        hot_path: str = "httptools",
    ) -> None:
        self.base_url = base_url
        self.control_timeout = control_timeout
        self._normal_auth = _bearer(api_key)
        self._admin_auth = _bearer(admin_api_key or api_key)  # ADMIN_OPTIONAL: the admin key when the engine has one
        connect_timeout = min(10.0, timeout)
        self._generate: EngineHTTP | _HttpxGenerate
        if hot_path == "httpx":
            self._generate = _HttpxGenerate(base_url, connections=connections, connect_timeout=connect_timeout)
        elif hot_path == "httptools":
            self._generate = EngineHTTP(base_url, connections=connections, connect_timeout=connect_timeout)
        else:
            raise ValueError(f"unknown engine client {hot_path!r}; one of {', '.join(ENGINE_CLIENTS)}")
        # Control calls (abort, close) must not queue behind a saturated generate pool: they are what frees it.
        self._control = EngineHTTP(base_url, connections=CONTROL_CONNECTIONS, connect_timeout=connect_timeout)
        # Told of every control call that failed (the call's path, "timeout" or "transport"): the metrics count them.
        self.on_control_failure: Callable[[str, str], None] = lambda _path, _kind: None
        # `stream: true` generates (SSE) on their own pool: a stream holds its connection for the whole reply.
        self._streaming = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(None, connect=connect_timeout),  # the streaming handler owns the deadline
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=32,
                                keepalive_expiry=IDLE_LIMIT),
            headers={"Content-Type": "application/json"},
            transport=httpx.AsyncHTTPTransport(retries=0),
        )

        # Behind smg --enable-rl (engine/routers.py): control calls go to every engine through smg's RL fan-out.
        self.fan_out = False

    def __repr__(self) -> str:  # never show the keys
        return f"EngineClient({self.base_url!r})"

    def _routed(self, routing_key: str) -> dict[str, str]:
        """Headers of a call about one session: its routing key (sticky placement behind sglang-router) and the
        normal API key."""
        return {ROUTING_HEADER: routing_key, **self._normal_auth}

    def _generating(self, routing_key: str) -> dict[str, str]:
        """A /generate's headers: `_routed`'s, and the turn's `traceparent` when tracing (session_server/tracing.py)."""
        trace = engine_headers()
        return self._routed(routing_key) if trace is None else {**self._routed(routing_key), **trace}

    async def aclose(self) -> None:
        await self._streaming.aclose()
        self._generate.close()
        if isinstance(self._generate, _HttpxGenerate):
            await self._generate.aclose()
        self._control.close()

    async def _request(
        self, method: str, path: str, body: bytes | None = None, *, headers: dict[str, str] | None = None,
        deadline: float | None = None,
    ) -> EngineReply:
        limit = self.control_timeout if deadline is None else deadline
        try:
            # The whole call is bounded, the wait for a free connection included; a call cut short closes its
            # connection whatever the phase (http11.py), so no deadline ever costs the pool a connection.
            async with asyncio.timeout(limit):
                status, content, content_type = await self._control.request(method, path, body or b"",
                                                                            headers or {})
        except TimeoutError as exc:
            self.on_control_failure(path, "timeout")
            raise EngineUnavailableError(f"engine {method} {path} did not answer within {limit:g}s") from exc
        except EngineUnavailableError as exc:
            self.on_control_failure(path, "transport")
            raise EngineUnavailableError(f"engine {method} {path} failed: {exc}") from exc
        return EngineReply(status, content, content_type)

    async def _control_call(self, path: str, body: dict[str, Any], *, headers: dict[str, str],
                       deadline: float | None = None) -> EngineReply:
        """POST a control call (abort, pause, engine sessions) to the engine, or through smg's fan-out to every
        engine behind it, its aggregate answered as one engine's (engine/routers.py)."""
        if not self.fan_out:
            return await self._request("POST", path, _json.encode(body), headers=headers, deadline=deadline)
        reply = await self._request("POST", fan_out_path(path), _json.encode(body), headers=headers, deadline=deadline)
        status, content = unpack_fan_out(reply.status, reply.body)
        return EngineReply(status, content, "application/json")

    async def generate(self, payload: bytes, routing_key: str) -> EngineReply:
        """POST /generate with an already encoded body (encoded off the loop), on the lean keep-alive pool."""
        status, body, content_type = await self._generate.post("/generate", payload, self._generating(routing_key))
        _check_credentials(status)
        return EngineReply(status, body, content_type)

    @contextlib.asynccontextmanager
    async def stream_generate(self, payload: bytes, routing_key: str) -> AsyncIterator[StreamedReply]:
        """POST /generate with `stream: true`; yields the open response (status and headers read, body not yet:
        `aiter_bytes()` / `aread()`), on the lean client (http11.EngineStream) unless `--engine-client httpx`.

        Leaving the block closes the connection, which SGLang (and the sim) treat as the client going away. Transport
        failures, also while the caller reads the body, become EngineUnavailableError (502).
        """
        if isinstance(self._generate, EngineHTTP):
            async with self._generate.stream("/generate", payload, self._generating(routing_key)) as stream:
                _check_credentials(stream.status_code)
                yield stream
            return
        request = self._streaming.build_request("POST", "/generate", content=payload,
                                                headers=self._generating(routing_key))
        try:
            response = await self._streaming.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(f"engine streaming /generate failed: {type(exc).__name__}: {exc}") from exc
        try:
            _check_credentials(response.status_code)
            yield response
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(f"engine stream broke: {type(exc).__name__}: {exc}") from exc
        finally:
            await response.aclose()

    async def abort(self, rid: str) -> Answer:
        """POST /abort_request for exactly this rid; DONE when the engine acknowledged it (SGLang answers 200).

        Bounded by the control timeout: a stalled engine costs the caller at most that long."""
        try:
            reply = await self._control_call("/abort_request", {"rid": rid, "abort_all": False},
                                             headers=self._admin_auth)
        except EngineUnavailableError as exc:
            logger.warning("abort of rid %s failed: %s", rid, exc)
            return Answer.RETRY
        if not reply.ok:
            logger.warning("abort of rid %s refused by the engine (%d): %r", rid, reply.status, reply.body[:200])
        return Answer.of(reply.status)

    async def generation_control(self, path: str, body: dict[str, Any], deadline: float | None = None) -> None:
        """POST /pause_generation or /continue_generation (admin calls); an engine that refuses is a 502 that says
        so, since the operator's weight update depends on it. `deadline`: the seconds it may take (default: the
        control timeout; a pause that aborts waits for every running request to end)."""
        reply = await self._control_call(path, body, headers=self._admin_auth, deadline=deadline)
        if not reply.ok:
            raise EngineUnavailableError(f"engine refused {path} ({reply.status}): {reply.body[:200]!r}")

    async def open_session(
        self, capacity_of_str_len: int, routing_key: str, idle_timeout: float | None = None,
        session_id: str | None = None, deadline: float | None = None,
    ) -> str:
        """POST /open_session (streaming). `idle_timeout` is sent as the engine session's `timeout` (seconds):
        without one, a session whose owner died holds its KV on the engine forever. `session_id` names the session
        ourselves, so one whose open timed out can still be closed (the engine may open it later). `deadline`: the
        seconds the call may take (default: the control timeout; a turn passes what its own deadline leaves)."""
        req: dict[str, Any] = {"capacity_of_str_len": capacity_of_str_len, "streaming": True}
        if session_id is not None:
            req["session_id"] = session_id
        if idle_timeout is not None:
            req["timeout"] = idle_timeout
        reply = await self._control_call("/open_session", req, headers=self._routed(routing_key), deadline=deadline)
        if not reply.ok:
            raise EngineUnavailableError(f"engine refused open_session ({reply.status}): {reply.body[:200]!r}")
        try:
            sid = msgspec.json.decode(reply.body)
        except msgspec.DecodeError as exc:
            raise EngineUnavailableError("engine open_session reply is not JSON") from exc
        if not isinstance(sid, str) or not sid:
            raise EngineUnavailableError(f"engine open_session returned {sid!r}, expected a session id string")
        return sid

    async def close_session(self, sid: str, routing_key: str) -> bool:
        try:
            reply = await self._control_call("/close_session", {"session_id": sid}, headers=self._routed(routing_key))
        except EngineUnavailableError as exc:
            logger.warning("close of engine session %s failed: %s", sid, exc)
            return False
        return reply.ok

    async def ready(self) -> bool:
        """SGLang's cheap readiness probe, GET /ready (200, or 503 while starting, paused or unhealthy).

        Never GET /health: in real SGLang that runs a one-token generation and takes at least a second."""
        try:
            reply = await self._request("GET", "/ready")
        except EngineUnavailableError:
            return False
        return reply.ok

    async def server_info(self) -> dict[str, Any] | None:
        """GET /server_info (or its alias /get_server_info, the only one smg passes through) as a dict, or None when
        the engine does not answer it."""
        try:
            reply = await self._request("GET", "/server_info", headers=self._normal_auth)
            if reply.status == 404:
                reply = await self._request("GET", "/get_server_info", headers=self._normal_auth)
        except EngineUnavailableError:
            return None
        if not reply.ok:
            return None
        try:
            info = msgspec.json.decode(reply.body)
        except msgspec.DecodeError:
            return None
        return info if isinstance(info, dict) else None

    async def models(self) -> EngineReply:
        return await self._request("GET", "/v1/models", headers=self._normal_auth)
