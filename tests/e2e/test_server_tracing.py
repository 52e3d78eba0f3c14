"""One trace per episode (`--otlp-endpoint`, session_server/tracing.py), against an OTLP/HTTP collector over loopback.

The agent here is an OpenTelemetry-instrumented program: its episode is a span, and each of its chat requests carries
that span's `traceparent`. Every turn must arrive at the collector as a span of the same trace, child of the agent's,
with what the turn did (segment, turn, API, prompt / cached / sampled tokens, engine rid, weight version, status), and
the engine's /generate (recorded by a proxy in front of the sim) must carry the turn span's own context, so an engine
that traces (SGLang's --enable-trace, tests/sglang/test_real_tracing.py) puts its spans under the turn. The pause and
continue admin calls are spans too. A server without the flag sends the engine no trace header and never imports
OpenTelemetry.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.otlp_collector import OtlpCollector, otlp_collector
from support.server import RecordingProxy, new_session
from support.stack import Stack, launch_stack
from trajectory import samples_from_json

ROOT = Path(__file__).resolve().parents[2]
TRACE_DUMP = ROOT / "out" / "viewer" / "trace-turn.json"


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[OtlpCollector, str]]:
    with otlp_collector() as c:
        yield c


@pytest.fixture(scope="module")
def stack(tokenizer_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
          collector: tuple[OtlpCollector, str]) -> Iterator[Stack]:
    servers = {"server": ("--otlp-endpoint", collector[1]), "untraced": ()}
    with launch_stack(tokenizer_dirs, tmp_path_factory.mktemp("stack"), servers=servers,
                      proxied={"server", "untraced"}) as s:
        yield s


class Agent:
    """An agent with its own OpenTelemetry tracer (service "agent") exporting to the same collector."""

    def __init__(self, url: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        self.provider = TracerProvider(resource=Resource.create({"service.name": "agent"}))
        self.provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=url + "/v1/traces")))
        self.tracer = self.provider.get_tracer("agent")

    def headers(self, span: Any) -> dict[str, str]:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
        return carrier


def ids(span: Any) -> tuple[str, str]:
    context = span.get_span_context()
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def chat(server: str, sid: str, messages: list[dict[str, Any]], headers: dict[str, str], **extra: Any) -> Any:
    resp = httpx.post(f"{server}/sessions/{sid}/v1/chat/completions", headers=headers, timeout=60,
                      json={"model": "m", "messages": messages, "max_tokens": 16, **extra})
    assert resp.status_code == 200, resp.text
    return resp


def test_each_turn_is_a_span_of_the_agents_trace_and_the_engine_gets_the_turns_context(
        stack: Stack, proxy: RecordingProxy, collector: tuple[OtlpCollector, str]) -> None:
    store, url = collector
    agent = Agent(url)
    sid = new_session(stack.server)
    with agent.tracer.start_as_current_span("episode") as episode:
        trace_id, episode_id = ids(episode)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Hello [[sim: reply Hi there.]]"}]
        first = chat(stack.server, sid, messages, agent.headers(episode)).json()
        messages += [first["choices"][0]["message"], {"role": "user", "content": "More [[sim: tokens 6]]"}]
        streamed = chat(stack.server, sid, messages, agent.headers(episode), stream=True)
        assert streamed.text.rstrip().endswith("data: [DONE]")
    agent.provider.shutdown()

    spans = store.wait_for(lambda s: len([x for x in s if x["attributes"].get("session.id") == sid]) == 2)
    turns = sorted((s for s in spans if s["attributes"].get("session.id") == sid),
                   key=lambda s: s["attributes"]["session.turn"])
    sample = samples_from_json(httpx.post(f"{stack.server}/sessions/{sid}/samples", timeout=60).json())[0]
    record = httpx.get(f"{stack.server}/sessions/{sid}", timeout=60).json()["records"]
    assert [t["name"] for t in turns] == ["session.turn", "session.turn"]
    assert {t["trace_id"] for t in turns} == {trace_id}
    assert {t["parent_span_id"] for t in turns} == {episode_id}
    assert {t["service"] for t in turns} == {"session-server"}
    for k, turn in enumerate(turns):
        attributes = turn["attributes"]
        assert attributes == {
            "session.id": sid, "session.api": "chat", "session.segment": 0, "session.turn": k,
            "http.status_code": 200, "engine.rid": record[k]["rid"], "engine.weight_version": "default",
            "turn.prompt_tokens": record[k]["prompt_tokens"], "turn.cached_tokens": record[k]["cached_tokens"],
            "turn.sampled_tokens": record[k]["completion_len"],
            "turn.finish_reason": record[k]["finish_reason"]["type"],
            "gen_ai.usage.input_tokens": record[k]["prompt_tokens"],
            "gen_ai.usage.output_tokens": record[k]["completion_len"],
        }
        assert turn["status"]["code"] != 2  # not ERROR
    assert turns[1]["attributes"]["turn.cached_tokens"] > 0 and sum(
        t["attributes"]["turn.sampled_tokens"] for t in turns) == int(sample.loss_mask.sum())
    agent_spans = [s for s in spans if s["service"] == "agent" and s["trace_id"] == trace_id]
    assert [s["name"] for s in agent_spans] == ["episode"]

    generates = [c for c in proxy.settled() if c["path"] == "/generate" and c["routing_key"] == sid]
    # W3C traceparent: version-trace_id-parent_id-flags (the flags say sampled, and random with SDK 1.45)
    assert [c["traceparent"].split("-")[:3] for c in generates] == [["00", trace_id, t["span_id"]] for t in turns]
    TRACE_DUMP.parent.mkdir(parents=True, exist_ok=True)
    TRACE_DUMP.write_text(json.dumps({"agent": agent_spans[0], "turn": turns[1],
                                      "engine_request_traceparent": generates[1]["traceparent"]}, indent=2))


def test_a_refused_turn_is_an_error_span_and_a_turn_without_traceparent_starts_a_trace(
        stack: Stack, collector: tuple[OtlpCollector, str]) -> None:
    store, _ = collector
    sid = new_session(stack.server)
    bad = httpx.post(f"{stack.server}/sessions/{sid}/v1/chat/completions", json={"model": "m", "messages": []},
                     timeout=60)
    assert bad.status_code == 400
    chat(stack.server, sid, [{"role": "user", "content": "Hi [[sim: reply Yes.]]"}], {})
    spans = store.wait_for(lambda s: len([x for x in s if x["attributes"].get("session.id") == sid]) == 2)
    refused, done = sorted((s for s in spans if s["attributes"].get("session.id") == sid),
                           key=lambda s: "session.turn" in s["attributes"])
    assert refused["attributes"]["http.status_code"] == 400 and refused["status"]["code"] == 2
    assert refused["status"]["message"].startswith("invalid_request")
    assert done["parent_span_id"] is None and done["attributes"]["session.turn"] == 0
    assert done["trace_id"] != refused["trace_id"]


def test_pause_and_continue_are_spans_of_the_trainers_trace(
        stack: Stack, collector: tuple[OtlpCollector, str]) -> None:
    store, url = collector
    trainer = Agent(url)
    with trainer.tracer.start_as_current_span("weight update") as update:
        trace_id, update_id = ids(update)
        headers = trainer.headers(update)
        assert httpx.post(f"{stack.server}/admin/pause", json={"mode": "drain"}, headers=headers).status_code == 200
        assert httpx.post(f"{stack.server}/admin/continue", headers=headers).status_code == 200
    trainer.provider.shutdown()
    spans = store.wait_for(lambda s: len([x for x in s if x["trace_id"] == trace_id]) == 3)
    admin = sorted((s for s in spans if s["trace_id"] == trace_id and s["service"] == "session-server"),
                   key=lambda s: s["start_ns"])
    assert [(s["name"], s["parent_span_id"]) for s in admin] == [("admin.pause", update_id),
                                                                 ("admin.continue", update_id)]


def test_without_the_flag_the_engine_gets_no_trace_header(stack: Stack, proxy: RecordingProxy) -> None:
    sid = new_session(stack.servers["untraced"])
    chat(stack.servers["untraced"], sid, [{"role": "user", "content": "Hi [[sim: reply Yes.]]"}],
         {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
    generates = [c for c in proxy.settled() if c["path"] == "/generate" and c["routing_key"] == sid]
    assert [c["traceparent"] for c in generates] == [None]


def test_the_server_never_imports_opentelemetry_without_the_flag() -> None:
    code = ("import sys, session_server.cli, session_server.app, session_server.turns.pipeline; "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
