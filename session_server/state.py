"""The process-wide objects a handler needs, created once by the app's lifespan and shared by every route."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from starlette.requests import Request

from trajectory import LinearTrajectory, ModelFamily

from .config import ServerConfig
from .cpu_pool import CpuPool
from .engine_drain import EngineDrains
from .engine_pool import EnginePool
from .engine_sessions import EngineSessions
from .journal import Journal
from .lifecycle import Lifecycle
from .metrics import Metrics
from .registry import Registry


@dataclass(eq=False)
class ServerState:
    config: ServerConfig
    family: ModelFamily
    registry: Registry
    lifecycle: Lifecycle
    engine: EnginePool  # one or more workers; the session-keyed EngineClient API (engine_pool.py)
    pool: CpuPool
    engine_sessions: EngineSessions | None
    metrics: Metrics = field(default_factory=Metrics)
    journal: Journal | None = None  # --journal
    drains: EngineDrains | None = None  # aborted engine requests ending in the background (engine_drain.py)
    instance_id: str = field(default_factory=lambda: secrets.token_hex(8))
    prompt_token_limit: int | None = None  # the engine's largest input, once learned (turn_limits.py)

    def new_trajectory(self) -> LinearTrajectory:
        return LinearTrajectory(
            self.family, max_rollback=self.config.max_rollback, matcher=self.config.message_matcher,
            special_tokens=self.config.special_tokens_in_content,
        )


def server_of(request: Request) -> ServerState:
    """The ServerState the lifespan put on the app (typed: Starlette's `app.state` is an untyped namespace)."""
    server: ServerState = request.app.state.server
    return server
