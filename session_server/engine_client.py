"""The one HTTP client to the engine (SGLang's native API, DESIGN.md 5.1).

Two pools for the whole process: the hot POST /generate runs on a lean keep-alive HTTP/1.1 pool (engine_http.py,
up to ServerConfig.engine_connections sockets), and control calls (abort, open/close session, health, models) on a small
httpx.AsyncClient, so an abort never queues behind a saturated generate pool. Transport failures become 502
(EngineUnavailableError); the engine's own non-2xx answers are returned as they are, so the chat handler can pass them
through unrecorded. Client headers are never forwarded; the only header we add is the sticky-routing key.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import httpx
import msgspec

from .engine_http import EngineHTTP
from .errors import EngineUnavailableError

logger = logging.getLogger("session_server.engine")

_json = msgspec.json.Encoder()
ROUTING_HEADER = "X-SMG-Routing-Key"


@dataclass(slots=True)
class EngineReply:
    status: int
    body: bytes
    content_type: str

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


ENGINE_CLIENTS = ("httptools", "httpx")


class _HttpxGenerate:
    """The hot path on httpx instead of engine_http.py (`--engine-client httpx`): same contract (a cancelled
    request closes its connection, transport failures are EngineUnavailableError, no resend), kept so the cost
    difference that justifies engine_http.py can be re-measured (`make bench-compare`)."""

    def __init__(self, base_url: str, *, connections: int, connect_timeout: float) -> None:
        self._client = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(None, connect=connect_timeout),  # the chat handler owns the request deadline
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
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


class EngineClient:
    def __init__(self, base_url: str, *, timeout: float, connections: int, hot_path: str = "httptools") -> None:
        self.base_url = base_url
        connect_timeout = min(10.0, timeout)
        self._generate: EngineHTTP | _HttpxGenerate
        if hot_path == "httpx":
            self._generate = _HttpxGenerate(base_url, connections=connections, connect_timeout=connect_timeout)
        elif hot_path == "httptools":
            self._generate = EngineHTTP(base_url, connections=connections, connect_timeout=connect_timeout)
        else:
            raise ValueError(f"unknown engine client {hot_path!r}; one of {', '.join(ENGINE_CLIENTS)}")
        # Control calls (abort, close) must not queue behind a saturated generate pool: they are what frees it.
        self._control = httpx.AsyncClient(
            base_url=base_url,
            timeout=httpx.Timeout(10.0),
            limits=httpx.Limits(max_connections=32, max_keepalive_connections=8),
            headers={"Content-Type": "application/json"},
        )

    async def aclose(self) -> None:
        self._generate.close()
        if isinstance(self._generate, _HttpxGenerate):
            await self._generate.aclose()
        await self._control.aclose()

    async def _request(
        self, client: httpx.AsyncClient, method: str, path: str, body: bytes | None = None, **kw: object
    ) -> EngineReply:
        try:
            resp = await client.request(method, path, content=body, **kw)  # type: ignore[arg-type]
        except httpx.TimeoutException as exc:
            raise EngineUnavailableError(f"engine {method} {path} timed out: {type(exc).__name__}") from exc
        except httpx.HTTPError as exc:
            raise EngineUnavailableError(f"engine {method} {path} failed: {type(exc).__name__}: {exc}") from exc
        return EngineReply(resp.status_code, resp.content, resp.headers.get("content-type", "application/json"))

    async def generate(self, payload: bytes, routing_key: str) -> EngineReply:
        """POST /generate with an already encoded body (encoded off the loop), on the lean keep-alive pool."""
        status, body, content_type = await self._generate.post("/generate", payload, {ROUTING_HEADER: routing_key})
        return EngineReply(status, body, content_type)

    async def abort(self, rid: str) -> bool:
        """POST /abort_request; True when the engine acknowledged it (SGLang always answers 200)."""
        try:
            reply = await self._request(
                self._control, "POST", "/abort_request", _json.encode({"rid": rid, "abort_all": False})
            )
        except EngineUnavailableError as exc:
            logger.warning("abort of rid %s failed: %s", rid, exc)
            return False
        return reply.ok

    async def open_session(self, capacity_of_str_len: int, routing_key: str) -> str:
        body = _json.encode({"capacity_of_str_len": capacity_of_str_len, "streaming": True})
        reply = await self._request(self._control, "POST", "/open_session", body, headers={ROUTING_HEADER: routing_key})
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
            reply = await self._request(
                self._control, "POST", "/close_session", _json.encode({"session_id": sid}),
                headers={ROUTING_HEADER: routing_key},
            )
        except EngineUnavailableError as exc:
            logger.warning("close of engine session %s failed: %s", sid, exc)
            return False
        return reply.ok

    async def health(self) -> bool:
        try:
            reply = await self._request(self._control, "GET", "/health")
        except EngineUnavailableError:
            return False
        return reply.ok

    async def models(self) -> EngineReply:
        return await self._request(self._control, "GET", "/v1/models")
