"""An OTLP/HTTP trace collector on a loopback port, in a thread of the test process (the pattern of SGLang's
`sglang/test/otel_collector.py`, over HTTP): `POST /v1/traces` bodies (protobuf ExportTraceServiceRequest, as the
OpenTelemetry SDK's OTLP/HTTP exporter sends them) are decoded with opentelemetry-proto and kept as plain dicts."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OtlpCollector:
    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.requests = 0
        self._lock = threading.Lock()

    async def _traces(self, request: Request) -> Response:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        body = await request.body()
        if request.headers.get("content-encoding") == "gzip":
            body = gzip.decompress(body)
        message = ExportTraceServiceRequest()
        message.ParseFromString(body)
        spans = []
        for resource_spans in message.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append({
                        "service": resource.get("service.name"), "name": span.name,
                        "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex() or None,
                        "start_ns": span.start_time_unix_nano, "end_ns": span.end_time_unix_nano,
                        "attributes": {a.key: _value(a.value) for a in span.attributes},
                        "status": {"code": int(span.status.code), "message": span.status.message},
                        "resource": resource,
                    })
        with self._lock:
            self.spans.extend(spans)
            self.requests += 1
        return Response(ExportTraceServiceResponse().SerializeToString(), media_type="application/x-protobuf")

    def wait_for(self, predicate: Callable[[list[dict[str, Any]]], bool],
                 timeout: float = 60.0) -> list[dict[str, Any]]:
        """The spans so far, once `predicate` holds for them (exporters batch: spans arrive seconds later); a bound
        that only turns a hang into a failure."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)


@contextmanager
def otlp_collector() -> Iterator[tuple[OtlpCollector, str]]:
    """A running collector and its base URL (http://127.0.0.1:PORT; traces at /v1/traces)."""
    collector = OtlpCollector()
    app = Starlette(routes=[Route("/v1/traces", collector._traces, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the collector did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield collector, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
