"""session_server.state: the process-wide objects every route shares, and how a route finds them.

New trajectories and segment sets must carry the server's flags (a session made by POST /sessions, on demand or
restored from a journal all come from here), each state gets its own identity and metrics, and `server_of` returns
the state the lifespan put on the app.
"""

from __future__ import annotations

import re

from starlette.applications import Starlette
from starlette.requests import Request

from session_server.config import ServerConfig
from session_server.cpu_pool import CpuPool
from session_server.metrics import Metrics
from session_server.sessions.lifecycle import Lifecycle
from session_server.sessions.registry import Registry
from session_server.state import ServerState, server_of
from trajectory import ModelFamily


def state(family: ModelFamily, **config: object) -> ServerState:
    cfg = ServerConfig(engine_url="http://127.0.0.1:9", tokenizer="(in process)", model_family=family.name,
                       cpu_workers=1, **config)  # type: ignore[arg-type]
    registry = Registry()
    return ServerState(config=cfg, family=family, registry=registry,
                       lifecycle=Lifecycle(registry, retry_after=1, metrics=Metrics()),
                       engine=None, pool=CpuPool(1), engine_sessions=None)  # type: ignore[arg-type]


def test_new_trajectories_carry_the_servers_flags(family: ModelFamily) -> None:
    server = state(family, max_rollback=3, message_matcher="strict", special_tokens_in_content="engine")
    try:
        first, second = server.new_trajectory(), server.new_trajectory()
        assert first is not second and first.family is family
        assert first.max_rollback == 3 and first.matcher.mode == "strict" and first.text_only is False
        default = state(family)
        assert default.new_trajectory().text_only is True and default.new_trajectory().max_rollback == 1
        default.pool.shutdown()
    finally:
        server.pool.shutdown()


def test_new_segment_sets_carry_the_servers_flags(family: ModelFamily) -> None:
    server = state(family, max_segments=5, on_divergence="reject", merge_segments=True, max_rollback=2)
    try:
        segments = server.new_segments()
        assert (segments.max_segments, segments.on_divergence, segments.merge) == (5, "reject", True)
        assert segments.main.max_rollback == 2  # every segment's trajectory from new_trajectory
        assert server.new_segments() is not segments
    finally:
        server.pool.shutdown()


def test_each_state_has_its_own_identity_metrics_and_caches(family: ModelFamily) -> None:
    a, b = state(family), state(family)
    try:
        assert re.fullmatch(r"[0-9a-f]{16}", a.instance_id) and a.instance_id != b.instance_id
        assert a.metrics is not b.metrics and a.first_turn_repeats is not b.first_turn_repeats
        assert (a.journal, a.drains, a.prompt_token_limit, a.lifecycle.pause.mode) == (None, None, None, None)
    finally:
        a.pool.shutdown()
        b.pool.shutdown()


def test_server_of_is_the_state_on_the_app(family: ModelFamily) -> None:
    server = state(family)
    try:
        app = Starlette()
        app.state.server = server
        request = Request({"type": "http", "app": app, "method": "GET", "path": "/", "headers": []})
        assert server_of(request) is server
    finally:
        server.pool.shutdown()
