"""One OpenTelemetry trace per episode (`--otlp-endpoint URL`; docs/viewer.md): every turn is a span, child of the
agent's `traceparent` when it sends one, and the engine's /generate carries the turn span's `traceparent`, so SGLang's
own spans (its `--enable-trace`) join the same trace; the pause / continue admin calls are spans too.

Off by default and free when off: nothing here imports OpenTelemetry until a `Tracer` is built (the SDK is the
optional extra `trace`), the turn pipeline's hooks are a `tracer is None` test, and the engine client's is one
ContextVar read. The turn span's context reaches the engine client through `ENGINE_TRACEPARENT`, a ContextVar set
in the handler's task: the engine requests run in that task or in tasks it creates, which copy its context, so the
turn pipeline and the engine client need no parameter for it. Spans leave in the background (the SDK's batch
processor, its own thread, OTLP/HTTP protobuf).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from trajectory import TurnRecord

if TYPE_CHECKING:
    from opentelemetry.trace import Span

TRACE_HEADERS = ("traceparent", "tracestate")
# The `traceparent` (and `tracestate`) the engine requests of the current turn carry; None when not tracing.
ENGINE_TRACEPARENT: ContextVar[dict[str, str] | None] = ContextVar("engine_traceparent", default=None)


def engine_headers() -> dict[str, str] | None:
    """The trace headers of the turn in progress, for the engine client's /generate."""
    return ENGINE_TRACEPARENT.get()


class Tracer:
    """The server's OTLP exporter and tracer; built once by the app when --otlp-endpoint is set."""

    def __init__(self, endpoint: str, *, service_name: str = "session-server",
                 attributes: Mapping[str, str] | None = None) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name, **(attributes or {})}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=_traces_url(endpoint))))
        self._tracer = self._provider.get_tracer("session_server")
        self._propagator = TraceContextTextMapPropagator()

    def _start(self, name: str, headers: Mapping[str, str], attributes: Mapping[str, Any]) -> Span:
        from opentelemetry.trace import SpanKind

        carrier = {h: headers[h] for h in TRACE_HEADERS if h in headers}
        parent = self._propagator.extract(carrier) if carrier else None
        return self._tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=dict(attributes))

    def turn(self, headers: Mapping[str, str], session_id: str, api: str) -> TurnSpan:
        """Start a turn's span and make its context the one the turn's engine requests carry."""
        from opentelemetry import trace

        span = self._start("session.turn", headers, {"session.id": session_id, "session.api": api})
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(span))
        ENGINE_TRACEPARENT.set(carrier)
        return TurnSpan(span)

    @contextlib.contextmanager
    def admin(self, name: str, headers: Mapping[str, str], **attributes: Any) -> Iterator[Span]:
        """A span around an admin call (pause, continue): what a trainer's weight update did to the episodes."""
        from opentelemetry.trace import Status, StatusCode

        span = self._start(name, headers, attributes)
        try:
            yield span
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            span.end()

    def shutdown(self) -> None:
        """Export what is queued and stop (the app's shutdown)."""
        self._provider.shutdown()


class TurnSpan:
    """A turn's span, ended once with what the turn did (`finish`)."""

    __slots__ = ("_span",)

    def __init__(self, span: Span) -> None:
        self._span = span

    def finish(self, facts: Mapping[str, Any], error: str | None = None) -> None:
        from opentelemetry.trace import Status, StatusCode

        self._span.set_attributes({k: v for k, v in facts.items() if v is not None})
        if error is not None:
            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end()


def turn_facts(turn: int, record: TurnRecord) -> dict[str, Any]:
    """A committed turn's span attributes: where it sits, what the engine saw, cached and sampled, by which weights.
    The token counts also go by the GenAI semantic conventions' names, which trace backends chart."""
    return {
        "session.turn": turn, "engine.rid": record.rid, "engine.weight_version": record.weight_version,
        "turn.prompt_tokens": record.prompt_tokens, "turn.cached_tokens": record.cached_tokens,
        "turn.sampled_tokens": record.completion_len, "turn.finish_reason": str(record.finish_reason.get("type")),
        "gen_ai.usage.input_tokens": record.prompt_tokens, "gen_ai.usage.output_tokens": record.completion_len,
    }


def _traces_url(endpoint: str) -> str:
    """An OTLP/HTTP collector's base URL (http://host:4318) or its traces URL (.../v1/traces), as given."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


def admin_span(tracer: Tracer | None, name: str, headers: Mapping[str, str],
               **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """`tracer.admin(...)`, or nothing when not tracing."""
    return contextlib.nullcontext() if tracer is None else tracer.admin(name, headers, **attributes)
