"""The process-wide objects a handler needs, created once by the app's lifespan and shared by every route."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from starlette.requests import Request

from session_server.config import ServerConfig
from session_server.cpu_pool import CpuPool
from session_server.engine.adapters import AdapterBook
from session_server.engine.drains import EngineDrains
from session_server.engine.placement import EnginePlacement
from session_server.engine.sessions import EngineSessions
from session_server.metrics import Metrics
from session_server.repeated_first_turns import RepeatedFirstTurns
from session_server.sessions.journal import Journal
from session_server.sessions.lifecycle import Lifecycle
from session_server.sessions.registry import Registry
from session_server.tracing import Tracer
from trajectory import LinearTrajectory, ModelFamily, SegmentSet


@dataclass(eq=False)
class ServerState:
    config: ServerConfig
    family: ModelFamily
    registry: Registry
    lifecycle: Lifecycle
    engine: EnginePlacement  # one or more workers; the session-keyed EngineClient API (engine/placement.py)
    pool: CpuPool
    engine_sessions: EngineSessions | None
    metrics: Metrics = field(default_factory=Metrics)
    journal: Journal | None = None  # --journal
    drains: EngineDrains | None = None  # aborted engine requests ending in the background (engine/drains.py)
    instance_id: str = field(default_factory=lambda: secrets.token_hex(8))
    prompt_token_limit: int | None = None  # the engine's largest input, once learned (turns/limits.py)
    # First requests seen before: a repeat whose ids are kept is prepared on the loop (repeated_first_turns.py).
    first_turn_repeats: RepeatedFirstTurns = field(default_factory=RepeatedFirstTurns)
    tracer: Tracer | None = None  # --otlp-endpoint: a span per turn and admin call (tracing.py)
    adapters: AdapterBook | None = None  # LoRA adapter revisions per session (engine/adapters.py)

    def new_trajectory(self) -> LinearTrajectory:
        return LinearTrajectory(
            self.family, max_rollback=self.config.max_rollback, matcher=self.config.message_matcher,
            special_tokens=self.config.special_tokens_in_content,
        )

    def new_segments(self) -> SegmentSet:
        config = self.config
        return SegmentSet(self.new_trajectory, max_segments=config.max_segments, on_divergence=config.on_divergence,
                          merge=config.merge_segments)


def server_of(request: Request) -> ServerState:
    """The ServerState the lifespan put on the app (typed: Starlette's `app.state` is an untyped namespace)."""
    server: ServerState = request.app.state.server
    return server
