"""The real app (session_server.app.build_app: its route table and front door) in process, for route unit tests.

Its lifespan is not run (httpx's ASGI transport sends no lifespan events): the test puts a ServerState of real
parts on the app -- registry, lifecycle, metrics, CPU pool, the family -- with a recording stand-in for the engine
placement, so no socket and no process is involved. Requests go through httpx.ASGITransport on the test's loop, so
a test can hold a chat's claim, send a request, and look at the server's state while that request waits.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
from starlette.applications import Starlette

from session_server.app import build_app
from session_server.config import ServerConfig
from session_server.cpu_pool import CpuPool
from session_server.engine.client import EngineReply
from session_server.engine.versions import cache_key
from session_server.errors import EngineUnavailableError
from session_server.metrics import Metrics
from session_server.sessions.lifecycle import Lifecycle
from session_server.sessions.registry import Registry
from session_server.state import ServerState
from trajectory import ModelFamily

MODELS = b'{"object": "list", "data": [{"id": "qwen/tiny", "object": "model"}, {"id": "org/other", "object": "model"}]}'


class StubEngine:
    """The session-keyed engine API the routes call (engine/placement.py), recording each call."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.healthy = True
        self.models_reply = EngineReply(200, MODELS, "application/json")
        self.refuse_pause = False
        self.refuse_continue = False
        self.weight_version = "default"

    async def ready(self) -> bool:
        self.calls.append("ready")
        return self.healthy

    def status(self) -> dict[str, Any]:
        return {"status": "ready" if self.healthy else "engine_unavailable",
                "engines": [{"url": "http://engine", "healthy": self.healthy}]}

    async def models(self) -> EngineReply:
        self.calls.append("models")
        return self.models_reply

    async def pause_in_place(self) -> None:
        self.calls.append("pause_in_place")
        if self.refuse_pause:
            raise EngineUnavailableError("the engine refused /pause_generation")

    async def continue_in_place(self) -> None:
        self.calls.append("continue_in_place")
        if self.refuse_continue:
            raise EngineUnavailableError("the engine refused /continue_generation")

    async def pause_cutting(self, deadline: float) -> None:
        self.calls.append("pause_cutting")
        if self.refuse_pause:
            raise EngineUnavailableError("the engine refused /pause_generation")

    async def learn_versions(self, version: str | None) -> bool:
        changed = version is not None and version != self.weight_version
        if version is not None:
            self.weight_version = version
        return changed

    def version_of(self, routing_key: str) -> str:
        return self.weight_version

    def learn_version(self, routing_key: str, version: str) -> bool:
        changed = version != self.weight_version
        self.weight_version = version
        return changed

    def cache_key_of(self, routing_key: str, version: str) -> str:
        return cache_key(version)

    def distrust_key(self, routing_key: str, version: str, key: str) -> None:
        self.calls.append("distrust_key")

    async def refresh_version(self, routing_key: str) -> None:
        self.calls.append("refresh_version")

    def forget(self, session_id: str) -> None:
        self.calls.append("forget")

    def place_beside(self, session_ids: Any, holder: str) -> None:
        self.calls.append("place_beside")


@contextlib.contextmanager
def in_process_app(family: ModelFamily, *, engine: Any = None, journal: Any = None, drains: Any = None,
                   **config: Any) -> Iterator[tuple[Starlette, ServerState]]:
    """The app and its state; `config`: ServerConfig fields. The CPU pool is shut down on exit."""
    cfg = ServerConfig(engine_url="http://127.0.0.1:9", tokenizer="(in process)", model_family=family.name,
                       cpu_workers=1, **config)
    app = build_app(cfg, family)
    metrics = Metrics()
    registry = Registry(cfg.tombstones, id_prefix=cfg.session_id_prefix)
    engine = engine if engine is not None else StubEngine()
    lifecycle = Lifecycle(registry, retry_after=cfg.retry_after, metrics=metrics, journal=journal, drains=drains,
                          max_sessions=cfg.max_sessions, engines=engine,
                          cut_replies=cfg.straddled_replies == "recompute")
    server = ServerState(config=cfg, family=family, registry=registry, lifecycle=lifecycle, engine=engine,
                         pool=CpuPool(1), engine_sessions=None, metrics=metrics, journal=journal, drains=drains)
    app.state.server = server
    try:
        yield app, server
    finally:
        server.pool.shutdown()


@contextlib.asynccontextmanager
async def client_of(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://server") as http:
        yield http
