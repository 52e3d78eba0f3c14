"""One trace from agent to engine: released SGLang 0.5.23 with its own tracing (`--enable-trace`, OTLP/HTTP) and the
session server with `--otlp-endpoint`, both exporting to one in-process collector over loopback
(tests/support/otlp_collector.py). An instrumented agent's episode span, the server's turn spans and SGLang's request
spans must all land in the agent's trace, SGLang's under the turn that sent the request (the server passes the turn
span's `traceparent` on /generate, which SGLang reads as the parent of its request span).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.launchers import SGLANG_CPU_PLUGIN, EngineProcess, start_session_server, start_sglang
from support.otlp_collector import OtlpCollector, otlp_collector
from support.server import new_session
from support.sglang_engine import CONSTRAINED, Engines, wait_engine_idle

FAMILY = "qwen3"
TRACE_DUMP = Path(__file__).resolve().parents[2] / "out" / "viewer" / "trace-real-engine.json"


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[OtlpCollector, str]]:
    with otlp_collector() as c:
        yield c


@pytest.fixture(scope="module")
def traced_engine(engines: Engines, collector: tuple[OtlpCollector, str]) -> Iterator[EngineProcess]:
    """The tiny dense Qwen3 on its own engine, tracing to the collector (its own: the shared ones do not trace)."""
    _, url = collector
    proc = start_sglang(engines.python, engines.checkpoint("qwen3-dense"), *CONSTRAINED, "--enable-trace",
                        "--otlp-traces-endpoint", f"{url}/v1/traces", plugin_dir=SGLANG_CPU_PLUGIN,
                        name="sglang[traced]",
                        env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"},
                        log_path=engines.logs / f"sglang-traced-{time.monotonic_ns()}.log")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def server(engines: Engines, traced_engine: EngineProcess, collector: tuple[OtlpCollector, str],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc = start_session_server(traced_engine.url, engines.checkpoint("qwen3-dense"), FAMILY, "--otlp-endpoint",
                                collector[1], log_dir=tmp_path_factory.mktemp("served"))
    try:
        yield proc.url
    finally:
        proc.close()


def test_the_agents_the_servers_and_the_engines_spans_make_one_trace(
        server: str, traced_engine: EngineProcess, collector: tuple[OtlpCollector, str]) -> None:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    store, url = collector
    provider = TracerProvider(resource=Resource.create({"service.name": "agent"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=url + "/v1/traces")))
    sid = new_session(server)
    with provider.get_tracer("agent").start_as_current_span("episode") as episode:
        trace_id = f"{episode.get_span_context().trace_id:032x}"
        headers: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(headers, context=trace.set_span_in_context(episode))
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Say something."}]
        for _ in range(2):
            resp = httpx.post(f"{server}/sessions/{sid}/v1/chat/completions", headers=headers, timeout=300,
                              json={"model": "m", "messages": messages, "max_tokens": 6, "temperature": 0})
            assert resp.status_code == 200, resp.text
            messages += [resp.json()["choices"][0]["message"], {"role": "user", "content": "Again."}]
    provider.shutdown()
    wait_engine_idle(traced_engine.url)

    def complete(spans: list[dict[str, Any]]) -> bool:
        """Both turns, and under each an engine span (SGLang exports in batches, each process on its own)."""
        ours = [s for s in spans if s["trace_id"] == trace_id]
        turns = {s["span_id"] for s in ours if s["name"] == "session.turn"}
        engine_parents = {s["parent_span_id"] for s in ours if s["service"] not in ("agent", "session-server")}
        return len(turns) == 2 and turns <= engine_parents

    spans = [s for s in store.wait_for(complete, timeout=120) if s["trace_id"] == trace_id]
    by_service: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        by_service.setdefault(span["service"], []).append(span)
    turns = by_service.get("session-server", [])
    engine = [s for name, group in by_service.items() if name not in ("agent", "session-server") for s in group]
    print("trace", trace_id, {name: sorted({s["name"] for s in group}) for name, group in by_service.items()})
    assert [s["name"] for s in by_service["agent"]] == ["episode"]
    assert sorted(s["attributes"]["session.turn"] for s in turns) == [0, 1]
    assert {s["parent_span_id"] for s in turns} == {by_service["agent"][0]["span_id"]}
    assert engine, f"no engine span in the trace: {sorted(by_service)}"
    # SGLang's request span (" Req <rid>") of each turn's /generate is a child of that turn's span; its other spans
    # (tokenize, prefill, decode, its threads' spans) hang under those, in the same trace.
    turn_ids = {s["span_id"] for s in turns}
    requests = [s for s in engine if s["parent_span_id"] in turn_ids]
    assert {s["parent_span_id"] for s in requests} == turn_ids  # both turns reached the engine, each under its span
    assert all(s["name"].strip().startswith("Req") for s in requests)
    names = {s["name"] for s in engine}
    assert {"tokenize", "prefill_forward", "decode_forward"} <= names
    TRACE_DUMP.parent.mkdir(parents=True, exist_ok=True)
    TRACE_DUMP.write_text(json.dumps(sorted(spans, key=lambda s: s["start_ns"]), indent=1))
