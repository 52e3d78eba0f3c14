"""session_server.metrics in process: per-app registries, the response counter's route templates, the lag ticker.

The response middleware runs around a small real Starlette app (driven through httpx's ASGI transport): it must
count every response exactly once by route template -- never the raw path -- including a 500 from an unhandled
exception, the 404 of an unknown path and a 405.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from session_server.errors import AbortReason
from session_server.http.front_door import UNMATCHED, FrontDoorApp
from session_server.metrics import STAGES, TOKEN_KINDS, LoopLagTicker, Metrics
from support.examples import examples


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition text, keyed by (sample name, sorted labels)."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def response_count(metrics: Metrics, route: str, method: str, status: int) -> float:
    key = ("session_server_responses_total", (("method", method), ("route", route), ("status", str(status))))
    return samples(metrics).get(key, 0.0)


async def _ok(request: Request) -> Response:
    return JSONResponse({"id": request.path_params.get("session_id")})


async def _boom(request: Request) -> Response:
    raise RuntimeError("a bug")


async def _not_found(request: Request, exc: Exception) -> Response:
    return JSONResponse({"error": "no route"}, status_code=404)


def _app(metrics: Metrics) -> Starlette:
    routes = [
        Route("/sessions/{session_id}", _ok, methods=["GET"]),
        Route("/boom", _boom, methods=["GET"]),
        # One endpoint under two templates (like a root chat route next to the session one).
        Route("/v1/chat", _ok, methods=["POST"]),
        Route("/sessions/{session_id}/v1/chat", _ok, methods=["POST"]),
    ]
    app = FrontDoorApp(routes=routes, exception_handlers={404: _not_found})
    app.state.server = SimpleNamespace(metrics=metrics)
    return app


def _drive(app: Starlette, calls: list[tuple[str, str]]) -> list[int]:
    async def main() -> list[int]:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return [(await http.request(method, path)).status_code for method, path in calls]

    return asyncio.run(main())


def test_every_response_counted_once_by_route_template() -> None:
    metrics = Metrics()
    calls = [("GET", f"/sessions/{i:032x}") for i in range(20)]
    calls += [("GET", "/boom"), ("GET", "/nowhere/abc"), ("DELETE", "/sessions/x"),
              ("POST", "/v1/chat"), ("POST", "/sessions/abc/v1/chat"), ("POST", "/sessions/def/v1/chat")]
    statuses = _drive(_app(metrics), calls)
    assert statuses == [200] * 20 + [500, 404, 405, 200, 200, 200]
    assert response_count(metrics, "/sessions/{session_id}", "GET", 200) == 20
    assert response_count(metrics, "/boom", "GET", 500) == 1
    assert response_count(metrics, UNMATCHED, "GET", 404) == 1
    assert response_count(metrics, "/sessions/{session_id}", "DELETE", 405) == 1
    assert response_count(metrics, "/v1/chat", "POST", 200) == 1
    assert response_count(metrics, "/sessions/{session_id}/v1/chat", "POST", 200) == 2
    # Bounded cardinality: one series per (template, method, status), never one per session id.
    series = [k for k in samples(metrics) if k[0] == "session_server_responses_total"]
    assert len(series) == 6
    assert sum(samples(metrics)[k] for k in series) == len(calls)


def test_each_app_has_its_own_registry() -> None:
    a, b = Metrics(), Metrics()
    _drive(_app(a), [("GET", "/sessions/x")])
    a.rollback("content")
    assert response_count(a, "/sessions/{session_id}", "GET", 200) == 1
    assert response_count(b, "/sessions/{session_id}", "GET", 200) == 0
    assert samples(a)[("session_server_rollbacks_total", (("reason", "content"),))] == 1
    assert samples(b)[("session_server_rollbacks_total", (("reason", "content"),))] == 0
    text = a.render().decode()
    assert "process_cpu_seconds_total" in text  # the process collector
    assert "_total_created" not in text and "_count_created" not in text  # no creation-timestamp series


def test_helpers_count_by_label_and_watch_reads_at_scrape_time() -> None:
    metrics = Metrics()
    live = {"n": 3}
    metrics.watch("sessions", "live sessions", lambda: live["n"])
    metrics.abort(AbortReason.DISCONNECT)
    metrics.abort(AbortReason.DISCONNECT)
    metrics.abort(AbortReason.EXPIRY)
    metrics.validation_failure("nan_logprob")
    metrics.turn_tokens(100, 60, 7)
    metrics.turn_tokens(10, 0, 3)
    metrics.stage("commit", 0.0002)
    metrics.chat_done(0.5, 0.4)
    s = samples(metrics)
    assert s[("session_server_aborts_total", (("cause", "disconnect"),))] == 2
    assert s[("session_server_aborts_total", (("cause", "expiry"),))] == 1
    assert s[("session_server_aborts_total", (("cause", "delete"),))] == 0  # every cause is exposed from the start
    assert s[("session_server_engine_validation_failures_total", (("rule", "nan_logprob"),))] == 1
    assert s[("session_server_tokens_total", (("kind", "prompt"),))] == 110
    assert s[("session_server_tokens_total", (("kind", "cached"),))] == 60
    assert s[("session_server_tokens_total", (("kind", "completion"),))] == 10
    assert s[("session_server_stage_seconds_count", (("stage", "commit"),))] == 1
    assert s[("session_server_chat_seconds_count", ())] == 1
    assert abs(s[("session_server_added_seconds_sum", ())] - 0.1) < 1e-9
    assert s[("session_server_sessions", ())] == 3
    live["n"] = 5
    assert samples(metrics)[("session_server_sessions", ())] == 5


def test_loop_lag_ticker_sees_a_blocked_loop() -> None:
    """Ticks are waited for by their count, not by a sleep: a loaded machine runs the ticker later, never sooner."""
    metrics = Metrics()

    def ticks() -> float:
        return samples(metrics)[("session_server_event_loop_lag_seconds_count", ())]

    async def until_ticks(n: float) -> None:
        while ticks() < n:  # noqa: ASYNC110 -- polls a counter; bounded by the wait_for below
            await asyncio.sleep(0.01)

    async def main() -> None:
        ticker = LoopLagTicker(metrics, interval=0.01)
        ticker.start()
        await until_ticks(1)
        time.sleep(0.2)  # noqa: ASYNC251 -- block the loop on purpose: the ticker wakes up late by at least this much
        await until_ticks(3)
        await ticker.stop()
        await ticker.stop()  # idempotent

    asyncio.run(asyncio.wait_for(main(), 60))
    s = samples(metrics)
    assert s[("session_server_event_loop_lag_seconds_count", ())] >= 3
    # The blocked tick landed in a bucket above 0.1 s.
    over = s[("session_server_event_loop_lag_seconds_count", ())] - s[
        ("session_server_event_loop_lag_seconds_bucket", (("le", "0.1"),))
    ]
    assert over >= 1


def _own_lines(metrics: Metrics) -> list[str]:
    """The exposition lines of the server's own metrics (the process and GC collectors change between reads)."""
    return [line for line in metrics.render().decode().splitlines() if "session_server_" in line]


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.one_of(
    st.tuples(st.just("stage"), st.sampled_from(STAGES), st.floats(-1.0, 1e4, allow_nan=False)),
    st.tuples(st.just("engine"), st.floats(0, 1e4)),
    st.tuples(st.just("done"), st.floats(0, 1e3), st.floats(0, 1e3)),
    st.tuples(st.just("tokens"), st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6)),
    st.tuples(st.just("response"), st.sampled_from(["/a", "/b/{x}"]), st.sampled_from(["GET", "POST"]),
              st.sampled_from([200, 404, 500])),
    st.tuples(st.just("scrape")),
), max_size=40))
def test_tallies_expose_what_direct_counts_would(ops: list[tuple[Any, ...]]) -> None:
    """The per-turn counts go to plain tallies folded in at collection; the exposition is the one prometheus_client
    writes when every count goes to its metric directly, byte for byte, and reads in between change nothing."""
    tallied, direct = Metrics(), Metrics()
    direct._tallies.clear()  # nothing folded in: its children hold only the counts made on them directly
    for op, *args in ops:
        if op == "stage":
            tallied.stage(*args)
            direct.stage_seconds.labels(args[0]).observe(args[1])
        elif op == "engine":
            tallied.engine(*args)
            direct.engine_seconds.observe(*args)
        elif op == "done":
            tallied.chat_done(*args)
            direct.chat_seconds.observe(args[0])
            direct.added_seconds.observe(max(0.0, args[0] - args[1]))
        elif op == "tokens":
            tallied.turn_tokens(*args)
            for kind, n in zip(TOKEN_KINDS, args, strict=True):
                direct.tokens.labels(kind).inc(n)
        elif op == "response":
            tallied.response(*args)
            direct.responses.labels(args[0], args[1], str(args[2])).inc()
        else:
            tallied.render()
    assert _own_lines(tallied) == _own_lines(direct)
