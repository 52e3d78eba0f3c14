"""rLLM's capture path against our replies: its model gateway (rllm-model-gateway 0.1.0, the package rLLM's trainer
puts between the agent and the engine; rLLM itself is not on PyPI) run in-process in front of one session of our
server, the agent on the official openai SDK through it, streamed and not.

The gateway injects `logprobs` and `return_token_ids` into each request, forwards it, and turns the reply into a
`TraceRecord` (`data_process.build_trace_record`, or `build_trace_record_from_chunks` for a stream: the prompt ids
from the first chunk, the completion ids and logprobs joined across chunks). The traces it serves
(GET /sessions/{id}/traces) must hold the session's exact ids and logprobs, call by call.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from capture_episode import TOOLS, Call, CallIds, assembled_message, assert_recovered, run_episode
from rllm_model_gateway.models import GatewayConfig, TraceRecord, WorkerConfig
from rllm_model_gateway.server import create_app
from starlette.testclient import TestClient

from support.stack import Stack


@contextlib.contextmanager
def gateway(server: str, session_id: str) -> Iterator[TestClient]:
    """rLLM's gateway app (lifespan run by the test client) with one worker: our session's API root. Health checks
    every hour: the gateway probes GET {worker}/health, which a session URL does not serve."""
    config = GatewayConfig(workers=[WorkerConfig(url=f"{server}/sessions/{session_id}", api_path="/v1")],
                           store_worker="memory", sync_traces=True, health_check_interval=3600.0)
    with TestClient(create_app(config)) as client:
        yield client


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_gateway_traces_hold_the_sessions_ids(trainer_stack: Stack, stream: bool) -> None:
    with contextlib.ExitStack() as stack:
        clients: dict[str, TestClient] = {}
        gateway_session = f"rllm-{uuid.uuid4().hex[:8]}"

        def call_for(sid: str) -> Call:
            http = clients["gw"] = stack.enter_context(gateway(trainer_stack.server, sid))
            assert http.post("/sessions", json={"session_id": gateway_session}).status_code == 200
            sdk = openai.OpenAI(base_url=f"{http.base_url}/sessions/{gateway_session}/v1", api_key="x",
                                http_client=http, max_retries=0)

            def call(messages: list[dict[str, Any]]) -> dict[str, Any]:
                if not stream:
                    completion = sdk.chat.completions.create(model="m", messages=messages, tools=TOOLS)  # type: ignore[arg-type]
                    return completion.choices[0].message.model_dump(exclude_none=True)
                chunks = sdk.chat.completions.create(model="m", messages=messages, tools=TOOLS,  # type: ignore[arg-type]
                                                     stream=True)
                return assembled_message([c.model_dump() for c in chunks])

            return call

        stored = run_episode(trainer_stack.server, call_for)
        traces = [TraceRecord.model_validate(t)
                  for t in clients["gw"].get(f"/sessions/{gateway_session}/traces").json()]
    assert_recovered(stored, [CallIds(t.prompt_token_ids, t.completion_token_ids, t.logprobs) for t in traces])

